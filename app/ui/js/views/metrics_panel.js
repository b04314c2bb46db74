// The job's live metric charts: loss, grad-norm, learning rate, tokens/s and memory first, every other numeric
// metric under "More metrics". Fed by the SSE stream through a MetricStore; redrawn at most once per frame.

import {h, fill} from "../dom.js";
import {LiveChart} from "../chart.js";
import {num} from "../format.js";

const MAIN = [
  {title: "Loss", match: (n) => /loss/.test(n) && !/scale|tokens/.test(n)},
  {title: "Grad norm", match: (n) => n === "grad_norm"},
  {title: "Learning rate", match: (n) => n === "lr"},
  {title: "Tokens/s", match: (n) => n === "tokens_per_s"},
  {title: "Memory (MB)", match: (n) => n.startsWith("mem_")},
];
const NOT_CHARTED = new Set(["iteration"]);  // the step axis itself

export class MetricsPanel {
  constructor(store) {
    this.store = store;
    this.charts = new Map();  // title -> LiveChart
    this.latest = h("div", {class: "latest"});
    this.main = h("div", {class: "charts"});
    this.more = h("div", {class: "charts"});
    this.moreBox = h("details", {class: "more", hidden: true}, h("summary", {}, "More metrics"), this.more);
    this.empty = h("p", {class: "muted"}, "No metrics yet. Training and evaluation jobs report a point per logged step; ",
      "preprocess and convert jobs report progress events instead.");
    this.el = h("div", {class: "metrics-panel"}, this.empty, this.latest, this.main, this.moreBox);
    this.frame = 0;
    this.visible = false;
    this.moreBox.addEventListener("toggle", () => this.update());
  }

  setVisible(visible) {
    this.visible = visible;
    if (visible) this.update();
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
    const main = MAIN.map((g) => {
      const series = all.filter((s) => g.match(s.name)).sort(byRank);
      series.forEach((s) => used.add(s));
      return {title: g.title, series, parent: this.main};
    }).filter((g) => g.series.length);
    const rest = new Map();
    for (const s of all) if (!used.has(s)) rest.set(s.name, [...(rest.get(s.name) || []), s]);
    const more = [...rest.entries()].sort(([a], [b]) => a.localeCompare(b))
      .map(([name, series]) => ({title: name, series: series.sort(byRank), parent: this.more}));
    return {main, more};
  }

  update() {
    const {main, more} = this.groups();
    this.empty.hidden = main.length + more.length > 0;
    this.moreBox.hidden = more.length === 0;
    this.moreBox.querySelector("summary").textContent = `More metrics (${more.length})`;
    const wanted = this.moreBox.open ? [...main, ...more] : main;
    for (const g of wanted) {
      const chart = this.charts.get(g.title);
      if (chart) { chart.setSeries(g.series); chart.invalidate(); }
      else this.charts.set(g.title, new LiveChart(g.parent, g.title, g.series));
    }
    this.renderLatest(main);
  }

  renderLatest(main) {
    const cells = main.flatMap((g) => g.series.filter((s) => s.rank === null || s.rank === 0).slice(0, 3))
      .filter((s) => s.n)
      .map((s) => h("div", {class: "stat"}, h("span", {class: "muted"}, s.label), h("b", {}, num(s.last()))));
    const steps = [...this.store.series.values()].reduce((m, s) => (s.n ? Math.max(m, s.x[s.n - 1]) : m), -Infinity);
    fill(this.latest, steps > -Infinity ? h("div", {class: "stat"}, h("span", {class: "muted"}, "step"), h("b", {}, num(steps))) : null, cells);
  }

  lastStep() {
    let step = null;
    for (const s of this.store.series.values()) if (s.n) step = Math.max(step ?? -Infinity, s.x[s.n - 1]);
    return step;
  }

  destroy() {
    cancelAnimationFrame(this.frame);
    this.charts.forEach((c) => c.destroy());
  }
}
