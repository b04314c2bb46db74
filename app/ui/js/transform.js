// What a chart does to a series before drawing: exponential smoothing (TensorBoard's debiased EMA), the x axis
// (step, wall time, relative time, consumed tokens) and export of the points a chart shows. Pure functions, no DOM.

import {lowerBound} from "./series.js";

export const X_MODES = {
  step: "step", wall: "wall time", relative: "relative time", tokens: "consumed tokens",
};

/** TensorBoard's smoothing: an EMA debiased by 1 - w^k so the first points are not pulled towards zero.
 * NaN/null points stay gaps and do not enter the average. Fills out[from:s.n) continuing from `state`
 * ({last, k, power}, updated in place) and returns out. */
function emaInto(s, weight, out, from, state) {
  let {last, k, power} = state;
  for (let i = from; i < s.n; i++) {
    const v = s.y[i];
    if (!Number.isFinite(v)) { out[i] = NaN; continue; }
    last = last * weight + (1 - weight) * v;
    k += 1;
    power *= weight;  // weight ** k without a pow per point
    out[i] = weight >= 1 ? v : last / (1 - power);
  }
  Object.assign(state, {last, k, power});
  return out;
}

/** The smoothed values of a whole series (a Float64Array of length s.n). */
export function ema(s, weight) {
  return emaInto(s, weight, new Float64Array(s.n), 0, {last: 0, k: 0, power: 1});
}

/** A series' smoothed twin. A live series only grows, so new points extend the cached average (O(new points));
 * a restart cut, a new weight or reallocated arrays start it over. */
export function smoothed(s, weight) {
  const c = s.smoothCache;
  if (c && c.weight === weight && c.x === s.x && c.cuts === s.cuts && c.n <= s.n) {
    if (c.n < s.n) {
      emaInto(s, weight, c.out, c.n, c.state);
      c.n = s.n;
      c.view.n = s.n;
    }
    return c.view;
  }
  const out = new Float64Array(s.x.length);  // the series' capacity: appends fit until it reallocates
  const state = {last: 0, k: 0, power: 1};
  emaInto(s, weight, out, 0, state);
  const view = {x: s.x, y: out, n: s.n, t: s.t};
  s.smoothCache = {weight, n: s.n, x: s.x, cuts: s.cuts, out, state, view};
  return view;
}

/** Linear interpolation of a monotone reference (xs ascending, vs non-decreasing, n points) at x. */
function interp(xs, vs, n, x) {
  if (!n) return NaN;
  const i = lowerBound(xs, n, x);
  if (i < n && xs[i] === x) return vs[i];
  if (i === 0) return vs[0] + (n > 1 ? (x - xs[0]) * (vs[1] - vs[0]) / ((xs[1] - xs[0]) || 1) : 0);
  if (i >= n) return vs[n - 1] + (n > 1 ? (x - xs[n - 1]) * (vs[n - 1] - vs[n - 2]) / ((xs[n - 1] - xs[n - 2]) || 1) : 0);
  const f = (x - xs[i - 1]) / (xs[i] - xs[i - 1]);
  return vs[i - 1] + f * (vs[i] - vs[i - 1]);
}

/** The reference of an axis: steps and the monotone value at each (time in s, or cumulative tokens). */
function reference(mode, store) {
  if (mode === "tokens") {
    const tok = store.series.get("tokens");
    if (!tok || !tok.n) return null;
    const cum = new Float64Array(tok.n);
    let sum = 0;
    for (let i = 0; i < tok.n; i++) { sum += Number.isFinite(tok.y[i]) ? tok.y[i] : 0; cum[i] = sum; }
    return {xs: tok.x, vs: cum, n: tok.n};
  }
  let best = null;
  for (const s of store.series.values()) {
    if (s.name.startsWith("sys_")) continue;  // device telemetry counts seconds, not training steps
    if (s.n > (best?.n || 0) && Number.isFinite(s.t[0])) best = s;
  }
  if (!best) return null;
  const vs = new Float64Array(best.n);
  let prev = -Infinity;
  for (let i = 0; i < best.n; i++) { prev = Math.max(prev, best.t[i] / 1000); vs[i] = prev; }  // keep it monotone
  if (mode === "relative") for (let i = best.n - 1; i >= 0; i--) vs[i] -= vs[0];
  return {xs: best.x, vs, n: best.n};
}

/** {mode, label, time, toX(step), toStep(x)}; falls back to the step axis when the store lacks the reference. */
export function xAxis(mode, store) {
  const ref = mode === "step" ? null : reference(mode, store);
  if (!ref) return {mode: "step", label: "step", time: false, toX: (s) => s, toStep: (x) => x};
  return {
    mode, label: X_MODES[mode], time: mode === "wall",
    toX: (step) => interp(ref.xs, ref.vs, ref.n, step),
    toStep: (x) => interp(ref.vs, ref.xs, ref.n, x),
  };
}

/** A series re-indexed on an axis (for charts of several runs, each with its own step -> x map): x = axis.toX(step),
 * nudged to stay strictly increasing (two points in one second, a plateau of tokens), y and times shared. The
 * copy is a snapshot: a live page makes a new one when points arrive. */
export function onAxis(s, axis) {
  if (axis.mode === "step") return s;
  const copy = Object.create(Object.getPrototypeOf(s));
  Object.assign(copy, s, {smoothCache: null, extentCache: null, x: new Float64Array(s.n), y: s.y.subarray(0, s.n),
    t: s.t.subarray(0, s.n)});
  let prev = -Infinity;
  for (let i = 0; i < s.n; i++) {
    let v = axis.toX(s.x[i]);
    if (!(v > prev)) v = prev + Math.max(1e-9, Math.abs(prev) * 1e-12);
    copy.x[i] = v;
    prev = v;
  }
  return copy;
}

/** The identity axis of series already on `mode`'s units (onAxis): labels and tick formats of that mode. */
export function identityAxis(mode) {
  return {mode, label: X_MODES[mode], time: mode === "wall", toX: (x) => x, toStep: (x) => x};
}

/** Does the store have what the mode needs (times, or a `tokens` series)? */
export function xModeAvailable(mode, store) {
  return mode === "step" || reference(mode, store) !== null;
}

/** Finite min and max of a series, extended incrementally as it grows (recomputed after a restart cut it). */
function extent(s) {
  let c = s.extentCache;
  if (!c || c.x !== s.x || c.cuts !== s.cuts || c.n > s.n) c = {x: s.x, cuts: s.cuts, n: 0, lo: Infinity, hi: -Infinity};
  for (let i = c.n; i < s.n; i++) {
    const v = s.y[i];
    if (!Number.isFinite(v)) continue;
    if (v < c.lo) c.lo = v;
    if (v > c.hi) c.hi = v;
  }
  c.n = s.n;
  s.extentCache = c;
  return c;
}

/** Empty: no finite point. Constant: every finite point equal. Such charts are folded away. */
export function flatness(seriesList) {
  let lo = Infinity, hi = -Infinity;
  for (const s of seriesList) {
    const e = extent(s);
    lo = Math.min(lo, e.lo);
    hi = Math.max(hi, e.hi);
  }
  if (lo === Infinity) return {kind: "empty"};
  return lo === hi ? {kind: "constant", value: lo} : null;
}

/** The undecimated points of each series within [stepMin, stepMax], with their smoothed value when smoothing.
 * [{label, name, rank, run?, points: [[step, x, value, smoothed]]}] */
export function visiblePoints(entries, stepMin, stepMax, axis, weight) {
  return entries.map(({series: s, label, run}) => {
    const sm = weight > 0 ? smoothed(s, weight).y : null;
    const points = [];
    for (let i = lowerBound(s.x, s.n, stepMin); i < s.n && s.x[i] <= stepMax; i++) {
      const v = Number.isFinite(s.y[i]) ? s.y[i] : null;
      const row = [s.x[i], axis.mode === "step" ? s.x[i] : axis.toX(s.x[i]), v];
      if (sm) row.push(Number.isFinite(sm[i]) ? sm[i] : null);
      points.push(row);
    }
    return {label, name: s.name, rank: s.rank, ...(run ? {run} : {}), points};
  });
}

function csvCell(v) {
  if (v === null || v === undefined) return "";
  const text = String(v);
  return /[",\n]/.test(text) ? `"${text.replace(/"/g, '""')}"` : text;
}

/** Long-format CSV: one row per point. */
export function toCsv(exported) {
  const smoothing = exported.smoothing > 0;
  const head = ["series", "run", "step", "x", "value", ...(smoothing ? ["smoothed"] : [])];  // x: on the chart's axis
  const rows = [head.join(",")];
  for (const s of exported.series) for (const p of s.points) rows.push([s.label, s.run || "", ...p].map(csvCell).join(","));
  return `${rows.join("\n")}\n`;
}
