// A live line chart: uPlot draws, we decimate. Every redraw re-decimates the visible step range to about two
// points per pixel column (downsample.js), so 100k-step series draw as fast as 1k-step ones and drag-to-zoom
// shows full detail again. Redraws are coalesced to one per animation frame however many points arrive.

import uPlot from "../vendor/uplot.js";
import {decimate} from "./downsample.js";
import {num} from "./format.js";
import {h} from "./dom.js";

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f", "#475569", "#b45309"];

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

export class LiveChart {
  /** parent: element to append to; title: text; series: [Series] (series.js). */
  constructor(parent, title, series, {height = 200} = {}) {
    this.title = title;
    this.series = series;
    this.height = height;
    this.zoom = null;  // [min, max] steps while zoomed in, else the full range follows the data
    this.frame = 0;
    this.el = h("div", {class: "chart", dataset: {chart: title}});
    parent.append(this.el);
    this.build();
    this.resizer = new ResizeObserver(() => this.resize());
    this.resizer.observe(this.el);
  }

  build() {
    this.u?.destroy();
    const width = Math.max(200, this.el.clientWidth || 400);
    const opts = {
      title: this.title, width, height: this.height,
      scales: {x: {time: false}},
      series: [
        {label: "step", value: (u, v) => (v === null || v === undefined ? "—" : num(Math.round(v)))},
        ...this.series.map((s, i) => ({
          label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
          value: (u, v) => num(v),
        })),
      ],
      axes: [{incrs: STEP_INCRS}, {size: axisWidth, values: (u, ticks) => ticks.map(tick)}],
      cursor: {drag: {x: true, y: false, setScale: false}},
      hooks: {setSelect: [(u) => this.onSelect(u)]},
    };
    this.u = new uPlot(opts, [[], ...this.series.map(() => [])], this.el);
    this.u.over.addEventListener("dblclick", () => { this.zoom = null; this.invalidate(); });
    this.u.over.title = "drag to zoom, double-click to reset";
    this.draw();
  }

  /** Same series list (by key) -> keep the chart; otherwise rebuild it with the new legend. */
  setSeries(series) {
    const keys = (list) => list.map((s) => s.key).join("|");
    if (keys(series) === keys(this.series)) return;
    this.series = series;
    this.build();
  }

  onSelect(u) {
    if (u.select.width > 3) {
      const min = u.posToVal(u.select.left, "x"), max = u.posToVal(u.select.left + u.select.width, "x");
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

  draw() {
    const started = performance.now();
    const range = this.zoom || this.fullRange();
    const columns = Math.max(50, Math.round(this.u.bbox.width / (window.devicePixelRatio || 1)));
    const data = range ? decimate(this.series, range[0], range[1], columns) : [[], ...this.series.map(() => [])];
    this.u.setData(data, !this.zoom);
    if (this.zoom) this.u.setScale("x", {min: this.zoom[0], max: this.zoom[1]});
    // Exposed for the browser test and for anyone curious in devtools.
    this.el.dataset.points = String(this.series.reduce((acc, s) => acc + s.n, 0));
    this.el.dataset.drawn = String(data[0].length);
    this.el.dataset.drawMs = (performance.now() - started).toFixed(1);
  }

  resize() {
    const width = this.el.clientWidth;
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
