// Compare runs: several jobs' metric on one chart (one colour per run, the legend naming each run and the spec
// fields in which it differs), a table of each run's best and last value, and the diff of their specs. The runs come
// from ?ids=a,b or from a metadata filter ?meta=key=value (the newest `limit` jobs carrying it); the metric, smoothing
// and log scale are in the URL too, so the link is the comparison.

import {api} from "../api.js";
import {h, fill} from "../dom.js";
import {LiveChart, COLORS} from "../chart.js";
import {num} from "../format.js";
import {setQuery} from "../router.js";
import {MetricStore} from "../series.js";
import {viewControls} from "./metrics_panel.js";
import {errorBox, stateBadge, viewFromQuery, viewToQuery} from "./widgets.js";

const PAGE = 10000;  // metric rows per request (the API's maximum)
const MAX_PAGES = 200;  // 2M rows a run at most; the status line says when a run was cut there

/** Every metric point of one job, paged by step, into a MetricStore. */
async function loadMetrics(jobId) {
  const store = new MetricStore();
  let since = -1, cut = false;
  for (let page = 0; ; page++) {
    if (page === MAX_PAGES) { cut = true; break; }
    const got = await api(`/v1/jobs/${encodeURIComponent(jobId)}/metrics`, {params: {since_step: since, limit: PAGE}});
    for (const p of got.data) store.add(p.step, p.rank, {[p.name]: p.value}, p.time);
    if (!got.has_more || got.next_since_step === null) break;
    since = got.next_since_step;
  }
  return {store, cut};
}

/** metadata "key=value" -> {"metadata[key]": value}. */
export function metaParams(meta) {
  const at = (meta || "").indexOf("=");
  return at > 0 ? {[`metadata[${meta.slice(0, at).trim()}]`]: meta.slice(at + 1).trim()} : {};
}

async function loadJobs(ids, meta, limit) {
  if (ids.length) return Promise.all(ids.map((id) => api(`/v1/jobs/${encodeURIComponent(id)}`)));
  if (!meta) return [];
  return (await api("/v1/jobs", {params: {...metaParams(meta), limit}})).data;
}

// Fields that differ between any two runs by construction (their own paths): listed last, kept out of the legend.
const PATHS = /^(save|load|output_prefix|data_path|tensorboard_dir|save_dir|load_dir|metadata|resources)$/;

/** Spec fields whose values are not all equal across the jobs (name excluded: the legend has it); hyperparameters
 * first, the runs' own paths last. */
export function differingFields(jobs) {
  const keys = [...new Set(jobs.flatMap((j) => Object.keys(j.spec || {})))].filter((k) => k !== "name").sort();
  const differ = keys.filter((k) => new Set(jobs.map((j) => JSON.stringify(j.spec?.[k] ?? null))).size > 1);
  return [...differ.filter((k) => !PATHS.test(k)), ...differ.filter((k) => PATHS.test(k))];
}

function short(v) {
  const text = v === undefined ? "—" : typeof v === "string" ? v : JSON.stringify(v);
  return text.length > 40 ? `${text.slice(0, 39)}…` : text;
}

export function renderCompare(root, {query}) {
  const ids = (query.get("ids") || "").split(",").map((s) => s.trim()).filter(Boolean);
  const meta = query.get("meta") || "";
  const limit = Math.min(20, Math.max(1, Number(query.get("limit")) || 5));
  const view = {...viewFromQuery(query), xMode: "step", store: null};
  let metric = query.get("metric") || "";
  let runs = [];  // [{job, store, color, label}]
  let chart = null;
  let alive = true;

  const save = () => setQuery({ids: ids.join(","), meta, limit: meta && limit !== 5 ? limit : "", metric, ...viewToQuery(view)});
  view.changed = save;
  const status = h("div", {class: "status", id: "compare-status"}, "loading…");
  const metricSel = h("select", {id: "compare-metric", "aria-label": "Metric"});
  metricSel.addEventListener("change", () => { metric = metricSel.value; save(); draw(); });
  const controls = viewControls(view, () => { save(); chart?.build(); }, null, {axes: false});
  const chartBox = h("div", {class: "charts compare-chart"});
  const bestBox = h("div", {class: "compare-best"});
  const diffBox = h("div", {class: "compare-diff"});
  root.append(h("section", {class: "card"},
    h("div", {class: "toolbar"}, h("h2", {}, "Compare runs"),
      h("div", {class: "filters"}, h("label", {class: "inline", for: "compare-metric"}, "Metric ", metricSel), controls.el)),
    status, chartBox, h("div", {class: "compare-tables"}, bestBox, diffBox)));

  function seriesFor(run) {
    const all = [...run.store.series.values()].filter((s) => s.name === metric);
    const s = all.find((x) => x.rank === null) || all.sort((a, b) => a.rank - b.rank)[0];
    if (!s) return null;
    s.display = run.label;
    s.color = run.color;
    s.run = run.job.id;
    return s;
  }

  function draw() {
    const series = runs.map(seriesFor).filter(Boolean);
    chart?.destroy();
    chart = series.length ? new LiveChart(chartBox, metric, series, {view, height: 320}) : null;
    if (!series.length) fill(chartBox, h("p", {class: "muted"}, `No run reports ${metric || "any metric"}.`));
    renderBest();
  }

  function renderBest() {
    const rows = runs.map((run) => {
      const s = [...run.store.series.values()].find((x) => x.name === metric && (x.rank === null || x.rank === 0));
      let best = null, at = null;
      if (s) for (let i = 0; i < s.n; i++) if (Number.isFinite(s.y[i]) && (best === null || s.y[i] < best)) { best = s.y[i]; at = s.x[i]; }
      return {run, best, at, last: s && s.n ? s.last() : null, steps: s ? s.n : 0};
    });
    const lowest = Math.min(...rows.map((r) => (r.best === null ? Infinity : r.best)));
    fill(bestBox, h("table", {class: "summary-table", id: "compare-best"},
      h("caption", {}, `${metric}: lowest and last value per run`),
      h("thead", {}, h("tr", {}, ["Run", "State", "Lowest", "at step", "Last", "Points"].map((t) => h("th", {scope: "col"}, t)))),
      h("tbody", {}, rows.map((r) => h("tr", {dataset: {job: r.run.job.id}, class: r.best === lowest ? "best" : ""},
        h("td", {}, h("span", {class: "swatch", style: {background: r.run.color}}), h("a", {href: `#/jobs/${r.run.job.id}`}, r.run.job.name || r.run.job.id)),
        h("td", {}, stateBadge(r.run.job.state)), h("td", {}, num(r.best)), h("td", {}, num(r.at)), h("td", {}, num(r.last)),
        h("td", {}, num(r.steps)))))));
  }

  function renderDiff(fields) {
    const jobs = runs.map((r) => r.job);
    fill(diffBox, h("table", {class: "summary-table", id: "compare-diff"},
      h("caption", {}, fields.length ? "Spec fields that differ" : "The specs are identical (name aside)"),
      h("thead", {}, h("tr", {}, h("th", {scope: "col"}, "field"), runs.map((r) => h("th", {scope: "col"}, r.job.name || r.job.id.slice(0, 8))))),
      h("tbody", {}, fields.map((f) => h("tr", {dataset: {field: f}}, h("th", {scope: "row", class: "mono"}, f),
        jobs.map((j) => h("td", {class: "mono small"}, short(j.spec?.[f]))))))));
  }

  (async () => {
    let jobs;
    try {
      jobs = await loadJobs(ids, meta, limit);
      if (!jobs.length) { fill(status, h("p", {class: "muted"}, "Pick runs in the ", h("a", {href: "#/jobs"}, "job list"), " (tick them, then Compare), or give ?meta=key=value.")); return; }
      const loaded = await Promise.all(jobs.map((j) => loadMetrics(j.id)));
      if (!alive) return;
      const fields = differingFields(jobs);
      runs = jobs.map((job, i) => ({
        job, store: loaded[i].store, cut: loaded[i].cut, color: COLORS[i % COLORS.length],
        label: [job.name || job.id.slice(0, 8), ...fields.filter((f) => !PATHS.test(f)).slice(0, 3).map((f) => `${f}=${short(job.spec?.[f])}`)].join(" "),
      }));
      const names = [...new Set(runs.flatMap((r) => r.store.names()))].filter((n) => n !== "iteration").sort();
      if (!names.includes(metric)) metric = ["lm_loss", "loss", ...names].find((n) => names.includes(n)) || "";
      fill(metricSel, names.map((n) => h("option", {value: n}, n)));
      metricSel.value = metric;
      save();
      const cut = runs.filter((r) => r.cut).map((r) => r.job.name || r.job.id);
      fill(status, h("span", {class: "muted"}, `${runs.length} runs`, cut.length ? ` (only the first ${MAX_PAGES * PAGE} points of ${cut.join(", ")})` : ""));
      renderDiff(fields);
      draw();
    } catch (err) {
      fill(status, errorBox(err));
    }
  })();
  return () => { alive = false; chart?.destroy(); };
}
