// Compare runs: several jobs' metric on one chart (one colour per run, the legend naming each run and the spec
// fields in which it differs), a table of each run's best and last value, and the diff of their specs. The runs come
// from ?ids=a,b or from a metadata filter ?meta=key=value (the newest `limit` jobs carrying it); the metric, smoothing,
// x axis and log scale are in the URL too, so the link is the comparison.
//
// Live: while a compared run is not finished, the page polls its state and its new points (cursor paging: none
// skipped or repeated) every few seconds. The x axis is per run (each run's own wall time, time since its own start,
// its own consumed tokens), so each run's series is re-indexed on it before the runs share one chart.

import {api, TERMINAL} from "../api.js";
import {h, fill} from "../dom.js";
import {LiveChart, COLORS} from "../chart.js";
import {num} from "../format.js";
import {setQuery} from "../router.js";
import {MetricStore} from "../series.js";
import {identityAxis, onAxis, xAxis, xModeAvailable} from "../transform.js";
import {viewControls} from "./metrics_panel.js";
import {errorBox, every, stateBadge, viewFromQuery, viewToQuery} from "./widgets.js";

const PAGE = 10000;  // metric rows per request (the API's maximum)
const MAX_PAGES = 200;  // 2M rows a run at most; the status line says when a run was cut there
export const POLL_MS = 3000;  // how often running runs are asked for new points

/** The metric points of one job after `feed.cursor` into `feed.store` (a new feed: all of them); `feed.cursor` moves
 * to the last point read. Returns how many points arrived. */
async function loadMetrics(jobId, feed) {
  let added = 0;
  for (let page = 0; ; page++) {
    if (feed.pages === MAX_PAGES) { feed.cut = true; break; }
    const params = {limit: PAGE, ...(feed.cursor ? {after: feed.cursor} : {})};
    const got = await api(`/v1/jobs/${encodeURIComponent(jobId)}/metrics`, {params});
    for (const p of got.data) feed.store.add(p.step, p.rank, {[p.name]: p.value}, p.time);
    added += got.data.length;
    feed.pages += 1;
    feed.cursor = got.next_cursor || feed.cursor;
    if (!got.has_more) break;
  }
  return added;
}

function newFeed() { return {store: new MetricStore(), cursor: null, pages: 0, cut: false}; }

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
  const view = {...viewFromQuery(query), store: null};
  let metric = query.get("metric") || "";
  let runs = [];  // [{job, store, color, label}]
  let chart = null;
  let alive = true;

  const save = () => setQuery({ids: ids.join(","), meta, limit: meta && limit !== 5 ? limit : "", metric, ...viewToQuery(view)});
  view.changed = save;
  const status = h("div", {class: "status", id: "compare-status"}, "loading…");
  const metricSel = h("select", {id: "compare-metric", "aria-label": "Metric"});
  metricSel.addEventListener("change", () => { metric = metricSel.value; save(); draw(); });
  const controls = viewControls(view, () => { save(); draw(); }, null,
    {available: (mode) => runs.length > 0 && runs.every((r) => xModeAvailable(mode, r.store))});
  const chartBox = h("div", {class: "charts compare-chart"});
  const bestBox = h("div", {class: "compare-best"});
  const diffBox = h("div", {class: "compare-diff"});
  root.append(h("section", {class: "card"},
    h("div", {class: "toolbar"}, h("h2", {}, "Compare runs"),
      h("div", {class: "filters"}, h("label", {class: "inline", for: "compare-metric"}, "Metric ", metricSel), controls.el)),
    status, chartBox, h("div", {class: "compare-tables"}, bestBox, diffBox)));

  /** The x axis every run has (step when one run lacks the wall times or the `tokens` series the mode needs). */
  const xMode = () => (runs.length && runs.every((r) => xModeAvailable(view.xMode, r.store)) ? view.xMode : "step");

  function seriesFor(run, mode) {
    const all = [...run.store.series.values()].filter((s) => s.name === metric);
    const s = all.find((x) => x.rank === null) || all.sort((a, b) => a.rank - b.rank)[0];
    if (!s) return null;
    s.display = run.label;
    s.color = run.color;
    s.run = run.job.id;
    return onAxis(s, xAxis(mode, run.store));
  }

  const allSeries = (mode) => runs.map((run) => seriesFor(run, mode)).filter(Boolean);

  /** A new chart (metric, axis or a control changed). */
  function draw() {
    const mode = xMode();
    const series = allSeries(mode);
    chart?.destroy();
    chart = series.length ? new LiveChart(chartBox, metric, series, {view, height: 320, axis: () => identityAxis(mode)}) : null;
    if (!series.length) fill(chartBox, h("p", {class: "muted"}, `No run reports ${metric || "any metric"}.`));
    if (chart) chart.el.dataset.xAxis = mode;
    controls.refresh();
    renderBest();
  }

  /** New points arrived: the same chart (zoom, hidden series kept) redraws, or a new one when the runs' series
   * changed (a run reported the metric for the first time). */
  function update() {
    const mode = xMode();
    const series = allSeries(mode);
    if (!chart || mode !== chart.el.dataset.xAxis) { draw(); return; }
    chart.setSeries(series);
    controls.refresh();
    renderBest();
  }

  function renderStatus() {
    const cut = runs.filter((r) => r.feed.cut).map((r) => r.job.name || r.job.id);
    const live = runs.filter((r) => !TERMINAL.has(r.job.state)).length;
    fill(status, h("span", {class: "muted", dataset: {live: String(live)}}, `${runs.length} runs`,
      live ? ` (${live} still running: updated every ${POLL_MS / 1000} s)` : "",
      cut.length ? ` (only the first ${MAX_PAGES * PAGE} points of ${cut.join(", ")})` : ""));
  }

  function setMetricOptions() {
    const names = [...new Set(runs.flatMap((r) => r.store.names()))].filter((n) => n !== "iteration").sort();
    if (!names.includes(metric)) metric = ["lm_loss", "loss", ...names].find((n) => names.includes(n)) || "";
    if ([...metricSel.options].map((o) => o.value).join() !== names.join()) {
      fill(metricSel, names.map((n) => h("option", {value: n}, n)));
    }
    metricSel.value = metric;
  }

  /** One poll: the state and new points of every run not finished yet. */
  async function poll() {
    const open = runs.filter((r) => !TERMINAL.has(r.job.state));
    if (!open.length) { stopPoll?.(); return; }
    let changed = false;
    for (const run of open) {
      const job = await api(`/v1/jobs/${encodeURIComponent(run.job.id)}`);
      // Read the points after the state: a run seen finished has all its points in this read.
      const added = await loadMetrics(run.job.id, run.feed);
      if (!alive) return;
      changed = changed || added > 0 || job.state !== run.job.state;
      run.job = job;
    }
    if (!changed) return;
    const before = metric;
    setMetricOptions();
    if (metric !== before) { save(); draw(); } else update();
    renderStatus();
  }
  let stopPoll = null;

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
      const feeds = jobs.map(newFeed);
      await Promise.all(jobs.map((j, i) => loadMetrics(j.id, feeds[i])));
      if (!alive) return;
      const fields = differingFields(jobs);
      runs = jobs.map((job, i) => ({
        job, feed: feeds[i], store: feeds[i].store, color: COLORS[i % COLORS.length],
        label: [job.name || job.id.slice(0, 8), ...fields.filter((f) => !PATHS.test(f)).slice(0, 3).map((f) => `${f}=${short(job.spec?.[f])}`)].join(" "),
      }));
      setMetricOptions();
      save();
      renderStatus();
      renderDiff(fields);
      draw();
      if (runs.some((r) => !TERMINAL.has(r.job.state))) stopPoll = every(POLL_MS, poll);
    } catch (err) {
      fill(status, errorBox(err));
    }
  })();
  return () => { alive = false; stopPoll?.(); chart?.destroy(); };
}
