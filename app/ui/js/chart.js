// A live line chart: uPlot draws, we decimate. Every redraw re-decimates the visible step range to about two
// points per pixel column (downsample.js), so 100k-step series draw as fast as 1k-step ones and drag-to-zoom
// shows full detail again. Redraws are coalesced to one per animation frame however many points arrive.
//
// Controls (view, shared by the charts of a page): smoothing weight, x axis; per chart: log y, reset zoom, CSV/JSON
// export of the points shown. The zoom is kept in steps, so it survives live updates, axis changes and rebuilds.
// A click on a legend entry hides or shows that series (its raw twin too when smoothing).

import uPlot from "../vendor/uplot.js";
import {decimate} from "./downsample.js";
import {duration, num} from "./format.js";
import {h} from "./dom.js";
import {smoothed, toCsv, visiblePoints, xAxis} from "./transform.js";

export const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f", "#475569", "#b45309"];

// Series after the first are dashed and thinner, so a line drawn over an equal one leaves it visible.
const DASHES = [undefined, [6, 4], [2, 4], [8, 4, 2, 4]];

// Steps are integers: tick every 1, 2, 5, 10, 20, 50, ... steps, never at 1.5.
const STEP_INCRS = Array.from({length: 24}, (_, i) => [1, 2, 5][i % 3] * 10 ** Math.floor(i / 3));

/** Tick labels: short ("3e-4", "0.25", "12,000"); float noise from the tick maths rounded away. */
function tick(v) {
  if (v === null || v === undefined) return "";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e7)) return Number(v.toPrecision(6)).toExponential();
  return Number(v.toPrecision(6)).toLocaleString("en-US", {maximumFractionDigits: 6});
}

/** The y axis as wide as its longest label (about 7 px a character at 12 px). */
function axisWidth(u, values) {
  const longest = Math.max(3, ...(values || []).map((v) => String(v).length));
  return 18 + 7 * longest;
}

/** A view with no controls: raw lines, step axis, linear y (benchmarks, tests). */
export function plainView(store = null) {
  return {smooth: 0, xMode: "step", logY: new Set(), store: store || {series: new Map()}, changed: () => {}};
}

function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], {type}));
  const a = h("a", {href: url, download: name});
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

export class LiveChart {
  /** parent: element to append to; title: text; series: [Series] (series.js); view: shared controls (plainView);
   * axis: () => an xAxis (transform.js) when the series' x already is the axis (the compare page maps each run). */
  constructor(parent, title, series, {height = 200, view = plainView(), axis = null} = {}) {
    this.title = title;
    this.series = series;
    this.height = height;
    this.view = view;
    this.axisOf = axis;
    this.zoom = null;  // [min, max] steps while zoomed in, else the full range follows the data
    this.hidden = new Set();  // labels of the series hidden from the legend
    this.frame = 0;
    this.paints = 0;  // uPlot paints so far (the browser test waits for one)
    const slug = title.replace(/[^A-Za-z0-9]+/g, "-").toLowerCase();
    this.logBox = h("input", {type: "checkbox", class: "log-y", id: `logy-${slug}-${Math.random().toString(36).slice(2, 7)}`,
      checked: view.logY.has(title), onchange: () => this.setLogY(this.logBox.checked)});
    this.tools = h("div", {class: "chart-tools", role: "group", "aria-label": `${title} chart controls`},
      h("label", {class: "inline", for: this.logBox.id}, this.logBox, "log y"),
      h("button", {type: "button", class: "small reset-zoom", title: "or double-click the chart",
        onclick: () => { this.zoom = null; this.invalidate(); }}, "Reset zoom"),
      h("button", {type: "button", class: "small export-csv", "aria-label": `Export ${title} as CSV`,
        onclick: () => download(`${slug}.csv`, toCsv(this.exportData()), "text/csv")}, "CSV"),
      h("button", {type: "button", class: "small export-json", "aria-label": `Export ${title} as JSON`,
        onclick: () => download(`${slug}.json`, JSON.stringify(this.exportData(), null, 1), "application/json")}, "JSON"));
    this.plot = h("div", {class: "plot"});
    this.el = h("div", {class: "chart", dataset: {chart: title}}, this.tools, this.plot);
    this.el.chart = this;  // the browser test reads the plotted data back (el.chart.u.data)
    parent.append(this.el);
    this.build();
    this.resizer = new ResizeObserver(() => this.resize());
    this.resizer.observe(this.el);
  }

  get smoothing() { return this.view.smooth > 0; }
  get logY() { return this.view.logY.has(this.title); }

  setLogY(on) {
    if (on) this.view.logY.add(this.title); else this.view.logY.delete(this.title);
    this.view.changed();
    this.build();
  }

  axis() { return this.axisOf ? this.axisOf() : xAxis(this.view.xMode, this.view.store); }

  /** The uPlot series: per series its smoothed line and, faint, its raw line; or the raw line alone. */
  lines() {
    const out = [];
    this.series.forEach((s, i) => {
      const color = s.color || COLORS[i % COLORS.length];
      const dash = DASHES[i % DASHES.length];  // equal series (allocated = reserved memory) stay told apart
      if (this.smoothing) {
        out.push({source: s, smooth: true, label: s.label, stroke: color, width: 1.8, dash});
        out.push({source: s, smooth: false, label: `${s.label} (raw)`, stroke: `${color}40`, width: 1});
      } else {
        out.push({source: s, smooth: false, label: s.label, stroke: color, width: i ? 1.5 : 2.5, dash});
      }
    });
    return out;
  }

  build() {
    this.u?.destroy();
    this.axisNow = this.axis();
    this.drawn = this.lines();
    const ax = this.axisNow;
    const width = Math.max(200, this.plot.clientWidth || this.el.clientWidth || 400);
    const xValue = ax.mode === "wall" ? (u, v) => (v == null ? "—" : new Date(v * 1000).toLocaleString("sv-SE"))
      : ax.mode === "relative" ? (u, v) => (v == null ? "—" : duration(v))
        : (u, v) => (v == null ? "—" : num(Math.round(v)));
    const xAxisOpts = ax.mode === "step" ? {incrs: STEP_INCRS}
      : ax.mode === "relative" ? {values: (u, ticks) => ticks.map((t) => duration(t))}
        : ax.mode === "tokens" ? {values: (u, ticks) => ticks.map(tick)} : {};
    const opts = {
      title: this.title, width, height: this.height,
      scales: {x: {time: ax.time}, y: this.logY ? {distr: 3} : {}},
      series: [
        {label: ax.label, value: xValue},
        ...this.drawn.map((line) => ({
          label: line.label, stroke: line.stroke, width: line.width, dash: line.dash, spanGaps: true,
          show: !this.hidden.has(line.source.label), value: (u, v) => num(v),
        })),
      ],
      axes: [{...xAxisOpts, label: ax.mode === "step" ? undefined : ax.label, labelSize: ax.mode === "step" ? 0 : 18},
        {size: axisWidth, values: (u, ticks) => ticks.map(tick)}],
      cursor: {drag: {x: true, y: false, setScale: false}},
      hooks: {setSelect: [(u) => this.onSelect(u)], setSeries: [(u, i, opts) => this.onToggle(u, i, opts)],
        draw: [() => this.onPainted()]},
    };
    this.u = new uPlot(opts, [[], ...this.drawn.map(() => [])], this.plot);
    this.u.over.addEventListener("dblclick", () => { this.zoom = null; this.invalidate(); });
    this.u.over.title = "drag to zoom, double-click to reset";
    this.el.dataset.logY = String(this.logY);
    this.el.dataset.lines = String(this.drawn.length);
    this.el.dataset.xAxis = ax.mode;
    this.draw();
  }

  /** A legend click: remember it (rebuilds keep it) and move the raw twin of a smoothed line along. */
  onToggle(u, i, opts) {
    if (!i || opts.show === undefined || this.toggling) return;
    const line = this.drawn[i - 1];
    if (opts.show) this.hidden.delete(line.source.label); else this.hidden.add(line.source.label);
    this.toggling = true;
    this.drawn.forEach((other, j) => {
      if (j !== i - 1 && other.source === line.source && u.series[j + 1].show !== opts.show) u.setSeries(j + 1, {show: opts.show});
    });
    this.toggling = false;
    this.el.dataset.hidden = [...this.hidden].join(",");
  }

  /** Same series list (by key) -> keep the chart and redraw with these series (they may be new objects);
   * otherwise rebuild it with the new legend. */
  setSeries(series) {
    const keys = (list) => list.map((s) => `${s.key}:${s.label}`).join("|");
    const same = keys(series) === keys(this.series);
    this.series = series;
    if (!same) { this.build(); return; }
    this.drawn = this.lines();
    this.invalidate();
  }

  onSelect(u) {
    if (u.select.width > 3) {
      const ax = this.axisNow;
      const min = ax.toStep(u.posToVal(u.select.left, "x")), max = ax.toStep(u.posToVal(u.select.left + u.select.width, "x"));
      if (max > min) this.zoom = [min, max];
    }
    u.setSelect({left: 0, top: 0, width: 0, height: 0}, false);
    this.invalidate();
  }

  fullRange() {
    let min = Infinity, max = -Infinity;
    for (const s of this.series) {
      if (!s.n) continue;
      min = Math.min(min, s.x[0]);
      max = Math.max(max, s.x[s.n - 1]);
    }
    return min === Infinity ? null : [min, max];
  }

  invalidate() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => { this.frame = 0; this.draw(); });
  }

  /** The arrays to decimate, one per uPlot series. */
  sources() {
    return this.drawn.map((line) => (line.smooth ? smoothed(line.source, this.view.smooth) : line.source));
  }

  draw() {
    this.started = performance.now();
    const ax = this.axisNow;
    const range = this.zoom || this.fullRange();
    const columns = Math.max(50, Math.round(this.u.bbox.width / (window.devicePixelRatio || 1)));
    const data = range ? decimate(this.sources(), range[0], range[1], columns) : [[], ...this.drawn.map(() => [])];
    if (ax.mode !== "step") data[0] = data[0].map(ax.toX);
    if (this.logY) for (let i = 1; i < data.length; i++) data[i] = data[i].map((v) => (v !== null && v > 0 ? v : null));
    this.u.setData(data, !this.zoom);
    if (this.zoom) this.u.setScale("x", {min: ax.toX(this.zoom[0]), max: ax.toX(this.zoom[1])});
    // Exposed for the browser test and for anyone curious in devtools.
    this.el.dataset.points = String(this.series.reduce((acc, s) => acc + s.n, 0));
    this.el.dataset.drawn = String(data[0].length);
    this.el.dataset.zoom = this.zoom ? this.zoom.map((v) => v.toFixed(2)).join(",") : "";
  }

  /** uPlot painted (in a microtask after setData): the redraw's time from draw() to pixels, for the curious. */
  onPainted() {
    this.paints = (this.paints || 0) + 1;
    if (this.started) this.el.dataset.drawMs = (performance.now() - this.started).toFixed(1);
  }

  /** What the chart shows, undecimated: the visible step range of every shown series (smoothed values too). */
  exportData() {
    const range = this.zoom || this.fullRange() || [0, -1];
    const entries = this.series.filter((s) => !this.hidden.has(s.label)).map((s) => ({series: s, label: s.label, run: s.run}));
    return {
      chart: this.title, x_axis: this.axisNow.label, smoothing: this.view.smooth, log_y: this.logY, step_range: range,
      columns: ["step", "x", "value", ...(this.smoothing ? ["smoothed"] : [])],
      series: visiblePoints(entries, range[0], range[1], this.axisNow, this.view.smooth),
    };
  }

  resize() {
    const width = this.plot.clientWidth;
    if (!width || width === this.u.width) return;
    this.u.setSize({width, height: this.height});
    this.invalidate();
  }

  destroy() {
    cancelAnimationFrame(this.frame);
    this.resizer.disconnect();
    this.u.destroy();
    this.el.remove();
  }
}
