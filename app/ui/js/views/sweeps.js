// Sweeps: "#/sweeps" lists the team's sweeps; "#/sweeps/<id>?sort=value|-value|number" is one sweep: its trials in a
// table sortable by the metric (pruned trials greyed, the best highlighted) and a scatter of each searched parameter
// against the metric (GET /v1/sweeps/{id}, refreshed every 3 s while the sweep runs).

import {api, ApiError} from "../api.js";
import {h, fill} from "../dom.js";
import {setQuery} from "../router.js";
import {stateBadge} from "./widgets.js";

const SVG = "http://www.w3.org/2000/svg";
const REFRESH_MS = 3000;

/** Trials ordered by `sort` ("value", "-value" or "number"); trials without a value last either way. */
export function sortTrials(trials, sort) {
  const key = sort.replace(/^-/, "") || "number";
  const sign = sort.startsWith("-") ? -1 : 1;
  return [...trials].sort((a, b) => {
    const x = a[key], y = b[key];
    if (x === null || x === undefined) return (y === null || y === undefined) ? a.number - b.number : 1;
    if (y === null || y === undefined) return -1;
    return sign * (x - y) || a.number - b.number;
  });
}

function fmt(v) {
  if (v === null || v === undefined) return "—";
  return typeof v === "number" ? (Math.abs(v) >= 1e-3 && Math.abs(v) < 1e4 ? v.toPrecision(4) : v.toExponential(2)) : String(v);
}

function trialClass(trial, best) {
  return [trial.state === "pruned" ? "pruned" : "", trial.job_id === best ? "best" : ""].filter(Boolean).join(" ");
}

function trialsTable(sweep, sort, onSort) {
  const names = Object.keys(sweep.spec.space || {});
  const best = sweep.result && sweep.result.best_job;
  const arrow = (key) => (sort === key ? " ▲" : sort === `-${key}` ? " ▼" : "");
  const header = (key, label) => h("th", {class: "sortable", dataset: {sort: key},
    onclick: () => onSort(sort === key ? `-${key}` : key)}, label + arrow(key));
  return h("table", {class: "grid trials"},
    h("thead", {}, h("tr", {}, header("number", "#"), h("th", {}, "state"), ...names.map((n) => h("th", {}, n)),
      header("value", `${sweep.metric} (${sweep.direction === "maximize" ? "max" : "min"})`), h("th", {}, "step"))),
    h("tbody", {}, sortTrials(sweep.trials, sort).map((t) => h("tr", {class: trialClass(t, best), dataset: {job: t.job_id}},
      h("td", {}, h("a", {href: `#/jobs/${encodeURIComponent(t.job_id)}`}, String(t.number))),
      h("td", {}, t.job_id === best ? `${t.state} · best` : t.state),
      ...names.map((n) => h("td", {}, fmt(t.params[n]))),
      h("td", {class: "num"}, fmt(t.value)), h("td", {class: "num"}, fmt(t.step))))));
}

function svg(tag, attrs = {}, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

/** One parameter against the metric: a point per trial with a value (log x for a log-range parameter). */
function scatter(sweep, name) {
  const W = 260, H = 180, P = 34;
  const dim = sweep.spec.space[name] || {};
  const trials = sweep.trials.filter((t) => t.value !== null && t.params[name] !== undefined);
  const choices = dim.choices ? dim.choices.map(String) : null;
  const xs = trials.map((t) => (choices ? choices.indexOf(String(t.params[name])) : dim.log ? Math.log10(t.params[name]) : t.params[name]));
  const ys = trials.map((t) => t.value);
  const span = (v) => { const lo = Math.min(...v), hi = Math.max(...v); return [lo, hi > lo ? hi : lo + 1]; };
  const [x0, x1] = choices ? [-0.5, choices.length - 0.5] : span(xs);
  const [y0, y1] = span(ys);
  const px = (x) => P + ((x - x0) / (x1 - x0)) * (W - P - 8);
  const py = (y) => H - P + 8 - ((y - y0) / (y1 - y0)) * (H - P);
  const root = svg("svg", {class: "scatter", viewBox: `0 0 ${W} ${H + 8}`, width: W, height: H + 8, "data-param": name});
  root.append(svg("line", {x1: P, y1: H - P + 8, x2: W - 8, y2: H - P + 8, class: "axis"}),
    svg("line", {x1: P, y1: 8, x2: P, y2: H - P + 8, class: "axis"}),
    svg("text", {x: W / 2, y: H + 4, "text-anchor": "middle"}, dim.log ? `${name} (log)` : name),
    svg("text", {x: 2, y: 14}, fmt(y1)), svg("text", {x: 2, y: H - P + 8}, fmt(y0)));
  const best = sweep.result && sweep.result.best_job;
  trials.forEach((t, i) => {
    const dot = svg("circle", {cx: px(xs[i]).toFixed(1), cy: py(ys[i]).toFixed(1), r: t.job_id === best ? 6 : 4,
      class: `dot ${trialClass(t, best)}`.trim()});
    dot.append(svg("title", {}, `#${t.number} ${name}=${fmt(t.params[name])} ${sweep.metric}=${fmt(t.value)} (${t.state})`));
    root.append(dot);
  });
  return root;
}

function renderSweep(view, sweep, sort, onSort) {
  const r = sweep.result;
  const pruned = sweep.trials.filter((t) => t.state === "pruned").length;
  fill(view,
    h("section", {class: "card"},
      h("h2", {}, `Sweep ${sweep.name}`, " ", stateBadge(sweep.state)),
      h("p", {class: "muted"}, `${sweep.trials.length} trials, ${pruned} pruned; ${sweep.spec.sampler} sampler, `
        + `${sweep.spec.pruner} pruner; ${sweep.metric} ${sweep.direction}`),
      r ? h("p", {class: "best-line"}, "Best: ", h("a", {href: `#/jobs/${encodeURIComponent(r.best_job)}`}, r.best_job),
        ` ${sweep.metric} = ${fmt(r.best_value)} with ${JSON.stringify(r.best_params)}`) : null),
    h("section", {class: "card"}, h("h3", {}, "Parameters against the metric"),
      h("div", {class: "scatters"}, Object.keys(sweep.spec.space || {}).map((n) => scatter(sweep, n)))),
    h("section", {class: "card"}, h("h3", {}, "Trials"), trialsTable(sweep, sort, onSort)));
}

export function renderSweeps(view, {params, query}) {
  if (params.length) return renderOne(view, params[0], query.get("sort") || "value");
  fill(view, h("section", {class: "card"}, h("h2", {}, "Sweeps"), h("p", {class: "muted"}, "Loading…")));
  api("/v1/sweeps").then((page) => fill(view, h("section", {class: "card"}, h("h2", {}, "Sweeps"),
    page.data.length ? h("table", {class: "grid sweeps"}, h("thead", {}, h("tr", {}, h("th", {}, "name"), h("th", {}, "state"), h("th", {}, "best"))),
      h("tbody", {}, page.data.map((s) => h("tr", {},
        h("td", {}, h("a", {href: `#/sweeps/${encodeURIComponent(s.id)}`}, s.name)), h("td", {}, s.state),
        h("td", {}, s.result ? fmt(s.result.best_value) : "—")))))
      : h("p", {class: "muted"}, "No sweeps yet (POST /v1/sweeps)."))))
    .catch((err) => fill(view, h("p", {class: "error"}, err.message)));
  return null;
}

function renderOne(view, id, initialSort) {
  let sort = initialSort, last = null, timer = null, stopped = false;
  const onSort = (next) => { sort = next; setQuery({sort}); if (last) renderSweep(view, last, sort, onSort); };
  const load = async () => {
    try {
      last = await api(`/v1/sweeps/${encodeURIComponent(id)}`);
      if (stopped) return;
      renderSweep(view, last, sort, onSort);
      if (last.state === "running") timer = setTimeout(load, REFRESH_MS);
    } catch (err) {
      if (!stopped) fill(view, h("p", {class: "error"}, err instanceof ApiError && err.status === 404 ? "No such sweep." : err.message));
    }
  };
  load();
  return () => { stopped = true; clearTimeout(timer); };
}
