// "#/runs?group=experiment|sweep|label&label=<key>": the team's jobs and the runs a notebook logged through the MLflow
// API (/api/2.0/mlflow/, the same token) in one list, grouped by experiment (a job's metadata.experiment, else the
// team's default experiment), by sweep (a trial's sweep label) or by the value of one label.

import {api} from "../api.js";
import {h, fill} from "../dom.js";
import {setQuery} from "../router.js";
import {stateBadge} from "./widgets.js";

const MLFLOW = "/api/2.0/mlflow";
const NONE = "(none)";

/** Rows for jobs and notebook runs alike: {id, name, state, source, href, labels, experiment, value}. */
export function jobRow(job) {
  const meta = job.metadata || {};
  return {id: job.id, name: job.name || job.id, state: job.state, source: job.kind, href: `#/jobs/${encodeURIComponent(job.id)}`,
    labels: meta, experiment: meta.experiment || null};
}

export function notebookRow(run, experiments) {
  const tags = Object.fromEntries((run.data.tags || []).map((t) => [t.key, t.value]));
  const metrics = Object.fromEntries((run.data.metrics || []).map((m) => [m.key, m.value]));
  return {id: run.info.run_id, name: run.info.run_name || run.info.run_id, state: run.info.status.toLowerCase(),
    source: "notebook", href: null, labels: tags, experiment: experiments[run.info.experiment_id] || run.info.experiment_id,
    metrics};
}

/** Map of group name to rows, in first-seen order; `key` picks a row's group. */
export function groupRows(rows, key) {
  const groups = new Map();
  for (const row of rows) {
    const name = key(row) ?? NONE;
    if (!groups.has(name)) groups.set(name, []);
    groups.get(name).push(row);
  }
  return groups;
}

function groupKey(group, label, defaultExperiment, sweepNames) {
  if (group === "sweep") return (r) => (r.labels.sweep ? sweepNames[r.labels.sweep] || r.labels.sweep : null);
  if (group === "label") return (r) => (label ? r.labels[label] : null);
  return (r) => r.experiment || defaultExperiment;
}

async function notebookRuns() {
  const found = await api(`${MLFLOW}/experiments/search`, {method: "POST", body: {max_results: 1000}});
  const experiments = Object.fromEntries((found.experiments || []).map((e) => [e.experiment_id, e.name]));
  const ids = Object.keys(experiments);
  if (!ids.length) return {experiments, runs: []};
  const runs = await api(`${MLFLOW}/runs/search`, {method: "POST", body: {experiment_ids: ids, max_results: 1000}});
  // job runs carry llmjobs.kind; they are listed from /v1/jobs already
  const own = (runs.runs || []).filter((r) => !(r.data.tags || []).some((t) => t.key === "llmjobs.kind"));
  return {experiments, runs: own.map((r) => notebookRow(r, experiments))};
}

function table(rows) {
  return h("table", {class: "grid runs"},
    h("thead", {}, h("tr", {}, h("th", {}, "name"), h("th", {}, "source"), h("th", {}, "state"), h("th", {}, "labels / tags"))),
    h("tbody", {}, rows.map((r) => h("tr", {class: r.source === "notebook" ? "notebook" : "", dataset: {run: r.id}},
      h("td", {}, r.href ? h("a", {href: r.href}, r.name) : r.name),
      h("td", {}, r.source), h("td", {}, stateBadge(r.state)),
      h("td", {class: "muted"}, Object.entries(r.labels).filter(([k]) => !k.startsWith("mlflow.")).map(([k, v]) => `${k}=${v}`).join(", "))))));
}

export function renderRuns(view, {query}) {
  const group = ["experiment", "sweep", "label"].includes(query.get("group")) ? query.get("group") : "experiment";
  const label = query.get("label") || "";
  const picker = h("select", {id: "group-by", "aria-label": "group runs by", onchange: (e) => { setQuery({group: e.target.value, label}); load(); }},
    ["experiment", "sweep", "label"].map((g) => h("option", {value: g, selected: g === group}, `by ${g}`)));
  const labelInput = h("input", {id: "group-label", "aria-label": "label key to group by", placeholder: "label key", value: label,
    onchange: (e) => { setQuery({group: picker.value, label: e.target.value}); load(); }});
  const body = h("div", {}, h("p", {class: "muted"}, "Loading…"));
  fill(view, h("section", {class: "card"}, h("h2", {}, "Runs"),
    h("p", {class: "muted"}, "Jobs and the runs notebooks log through the MLflow API, grouped."),
    h("div", {class: "controls"}, picker, labelInput), body));
  let stopped = false;
  async function load() {
    try {
      const [jobs, notebook, sweeps, me] = await Promise.all([api("/v1/jobs", {params: {limit: 200}}), notebookRuns(),
        api("/v1/sweeps"), api(`${MLFLOW}/experiments/get`, {params: {experiment_id: "0"}})]);
      if (stopped) return;
      const sweepNames = Object.fromEntries(sweeps.data.map((s) => [s.id, s.name]));
      const rows = [...jobs.data.map(jobRow), ...notebook.runs];
      const groups = groupRows(rows, groupKey(picker.value, labelInput.value, me.experiment.name, sweepNames));
      fill(body, [...groups].map(([name, members]) => h("section", {class: "run-group", dataset: {group: name}},
        h("h3", {}, `${name} `, h("span", {class: "muted"}, `(${members.length})`)), table(members))));
    } catch (err) {
      if (!stopped) fill(body, h("p", {class: "error"}, err.message));
    }
  }
  load();
  return () => { stopped = true; };
}
