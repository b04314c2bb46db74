// The job's live metric charts: loss (with an MoE run's load-balancing loss), expert load imbalance, grad-norm,
// learning rate, tokens/s and memory first, every other numeric
// metric under "More metrics"; charts with no finite point or one constant value are folded into one line instead.
// Smoothing and the x axis apply to every chart (as TensorBoard's sidebar); log y is per chart. Fed by the SSE
// stream through a MetricStore; redrawn at most once per frame.

import {h, fill} from "../dom.js";
import {LiveChart} from "../chart.js";
import {num} from "../format.js";
import {X_MODES, flatness, xModeAvailable} from "../transform.js";
import {DEVICES, MAIN} from "../chart_groups.js";

const NOT_CHARTED = new Set(["iteration", "sys_device_id"]);  // the step axis itself; the device's id on its host

/** The chart controls of a page: smoothing slider and x axis select, bound to view = {smooth, xMode, logY}.
 * An axis option is disabled while `available(mode)` (default: the store has what the mode needs) says no. */
export function viewControls(view, onChange, store = null, {axes = true, available = null} = {}) {
  const value = h("output", {id: "smooth-value", for: "smooth"}, view.smooth.toFixed(2));
  const slider = h("input", {type: "range", id: "smooth", min: 0, max: 0.99, step: 0.01, value: String(view.smooth),
    "aria-label": "Smoothing (exponential moving average weight)"});
  slider.addEventListener("input", () => { value.textContent = Number(slider.value).toFixed(2); });
  slider.addEventListener("change", () => { view.smooth = Number(slider.value); onChange(true); });
  const axis = h("select", {id: "x-axis", "aria-label": "X axis"},
    Object.entries(X_MODES).map(([k, label]) => h("option", {value: k}, label)));
  axis.value = view.xMode;
  axis.addEventListener("change", () => { view.xMode = axis.value; onChange(true); });
  const el = h("div", {class: "toolbar chart-controls"},
    h("label", {class: "inline", for: "smooth"}, "Smoothing ", slider, value),
    axes ? h("label", {class: "inline", for: "x-axis"}, "X axis ", axis) : null);
  const refresh = () => {
    if (!store && !available) return;
    for (const option of axis.options) option.disabled = !(available ? available(option.value) : xModeAvailable(option.value, store));
  };
  return {el, refresh};
}

export class MetricsPanel {
  /** view: {smooth, xMode, logY: Set of chart titles, changed()} kept in the page's URL by its owner. */
  constructor(store, view) {
    this.store = store;
    this.view = {...view, store, changed: () => view.changed?.(this.view)};
    this.charts = new Map();  // title -> LiveChart
    this.controls = viewControls(this.view, () => this.rebuild(), store);
    this.latest = h("div", {class: "latest"});
    this.main = h("div", {class: "charts"});
    this.more = h("div", {class: "charts"});
    this.moreBox = h("details", {class: "more", hidden: true}, h("summary", {}, "More metrics"), this.more);
    this.flat = h("p", {class: "muted small flat-charts", id: "flat-charts", hidden: true});
    this.deviceView = {...this.view, xMode: "step"};
    this.devices = h("div", {class: "charts", id: "device-charts"});
    this.devicesBox = h("section", {class: "devices-box", hidden: true, "aria-label": "Device telemetry"},
      h("h3", {}, "Devices ", h("span", {class: "muted small"}, "(sampled by the worker; x: seconds since the node started)")), this.devices);
    this.empty = h("p", {class: "muted"}, "No metrics yet. Training and evaluation jobs report a point per logged step; ",
      "preprocess and convert jobs report progress events instead.");
    this.el = h("div", {class: "metrics-panel"}, this.empty, this.controls.el, this.latest, this.main, this.devicesBox, this.moreBox,
      this.flat);
    this.frame = 0;
    this.visible = false;
    this.moreBox.addEventListener("toggle", () => this.update());
  }

  setVisible(visible) {
    this.visible = visible;
    if (visible) this.update();
  }

  /** A control changed: every chart rebuilds (series count, scales) and the URL follows. */
  rebuild() {
    this.view.changed();
    this.deviceView.smooth = this.view.smooth;
    this.charts.forEach((c) => c.build());
  }

  /** Called after every batch of stream messages. */
  changed() {
    if (!this.visible || this.frame) return;
    this.frame = requestAnimationFrame(() => { this.frame = 0; this.update(); });
  }

  groups() {
    const all = [...this.store.series.values()].filter((s) => !NOT_CHARTED.has(s.name));
    const byRank = (a, b) => (a.name === b.name ? (a.rank ?? -1) - (b.rank ?? -1) : a.name.localeCompare(b.name));
    const used = new Set();
    const devices = DEVICES.map((g) => {
      const series = all.filter((s) => g.match(s.name)).sort(byRank);
      series.forEach((s) => used.add(s));
      return {title: g.title, series, parent: this.devices, view: this.deviceView};
    }).filter((g) => g.series.length);
    const main = MAIN.map((g) => {
      const series = all.filter((s) => g.match(s.name)).sort(byRank);
      series.forEach((s) => used.add(s));
      return {title: g.title, series, parent: this.main};
    }).filter((g) => g.series.length);
    const rest = new Map();
    for (const s of all) if (!used.has(s)) rest.set(s.name, [...(rest.get(s.name) || []), s]);
    const more = [...rest.entries()].sort(([a], [b]) => a.localeCompare(b))
      .map(([name, series]) => ({title: name, series: series.sort(byRank), parent: this.more}));
    return {main, more, devices};
  }

  update() {
    const {main, more, devices} = this.groups();
    const folded = [];
    const keep = (g) => {
      const flat = flatness(g.series);
      if (!flat) return true;
      folded.push(`${g.title}: ${flat.kind === "empty" ? "no value" : `constant ${num(flat.value)}`}`);
      this.charts.get(g.title)?.destroy();
      this.charts.delete(g.title);
      return false;
    };
    const shownMain = main.filter(keep), shownMore = more.filter(keep);
    this.devicesBox.hidden = !devices.length;
    this.empty.hidden = main.length + more.length + devices.length > 0;
    this.controls.el.hidden = !this.empty.hidden;
    this.controls.refresh();
    this.moreBox.hidden = shownMore.length === 0;
    this.moreBox.querySelector("summary").textContent = `More metrics (${shownMore.length})`;
    this.flat.hidden = !folded.length;
    this.flat.textContent = `Not charted (empty or constant): ${folded.join("; ")}`;
    const wanted = [...shownMain, ...devices, ...(this.moreBox.open ? shownMore : [])];
    for (const g of wanted) {
      const chart = this.charts.get(g.title);
      if (chart) { chart.setSeries(g.series); chart.invalidate(); }
      else this.charts.set(g.title, new LiveChart(g.parent, g.title, g.series, {view: g.view || this.view}));
    }
    this.keepOrder(wanted);
    this.renderLatest(main);
  }

  /** Charts in their group order (loss first), whatever order their first points arrived in. */
  keepOrder(groups) {
    for (const parent of [this.main, this.devices, this.more]) {
      const want = groups.filter((g) => g.parent === parent).map((g) => this.charts.get(g.title).el);
      if (want.some((el, i) => parent.children[i] !== el)) parent.append(...want);
    }
  }

  renderLatest(main) {
    const cells = main.flatMap((g) => g.series.filter((s) => s.rank === null || s.rank === 0).slice(0, 3))
      .filter((s) => s.n)
      .map((s) => h("div", {class: "stat"}, h("span", {class: "muted"}, s.label), h("b", {}, num(s.last()))));
    const step = this.lastStep();
    fill(this.latest, step !== null ? h("div", {class: "stat"}, h("span", {class: "muted"}, "step"), h("b", {}, num(step))) : null, cells);
  }

  /** The last training step (device telemetry counts seconds, not steps). */
  lastStep() {
    let step = null;
    for (const s of this.store.series.values()) if (s.n && !s.name.startsWith("sys_")) step = Math.max(step ?? -Infinity, s.x[s.n - 1]);
    return step;
  }

  destroy() {
    cancelAnimationFrame(this.frame);
    this.charts.forEach((c) => c.destroy());
  }
}
