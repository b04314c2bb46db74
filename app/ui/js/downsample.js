// Min/max decimation per pixel column, for aligned multi-series line charts.
//
// A chart W pixels wide can show at most one vertical stroke per column, so for each of W buckets of the visible
// step range we keep, per series, its minimum and its maximum (in the order they occur). Every spike survives
// (unlike averaging or stride sampling, the MLflow #11444 complaint) and the drawn point count is at most
// 2 * (W + 2) whatever the series length. All series share the bucket's first and last step as x positions, which
// is off by less than a pixel and keeps the data aligned the way uPlot wants it.

import {lowerBound} from "./series.js";

/**
 * series: [{x: Float64Array, y: Float64Array, n}] with x ascending; [xMin, xMax] the visible range; buckets ~ pixels.
 * Returns [xs, ys_0, ys_1, ...] (plain arrays; null where a series has no finite value there).
 * One point on each side outside the range is kept so lines run to the plot's edges when zoomed in.
 */
export function decimate(series, xMin, xMax, buckets) {
  buckets = Math.max(1, Math.floor(buckets));
  const spans = series.map((s) => span(s, xMin, xMax));
  const total = spans.reduce((acc, [lo, hi]) => acc + hi - lo, 0);
  if (total <= 2 * buckets || !(xMax > xMin)) return merge(series, spans);
  return bucketed(series, spans, xMin, xMax, buckets);
}

/** [lo, hi) of the points inside [xMin, xMax] plus one neighbour on each side. */
function span(s, xMin, xMax) {
  const lo = Math.max(0, lowerBound(s.x, s.n, xMin) - 1);
  const hi = Math.min(s.n, upperBound(s.x, s.n, xMax) + 1);
  return [lo, hi];
}

function upperBound(x, n, value) {
  let lo = 0, hi = n;
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    if (x[mid] <= value) lo = mid + 1; else hi = mid;
  }
  return lo;
}

function finite(v) { return Number.isFinite(v) ? v : null; }

/** Exact union of the series' steps (few points: nothing to decimate). */
function merge(series, spans) {
  const steps = new Set();
  series.forEach((s, i) => { for (let j = spans[i][0]; j < spans[i][1]; j++) steps.add(s.x[j]); });
  const xs = [...steps].sort((a, b) => a - b);
  const out = [xs];
  series.forEach((s, i) => {
    const ys = new Array(xs.length).fill(null);
    let j = spans[i][0];
    for (let k = 0; k < xs.length && j < spans[i][1]; k++) {
      if (s.x[j] === xs[k]) { ys[k] = finite(s.y[j]); j++; }
    }
    out.push(ys);
  });
  return out;
}

function bucketed(series, spans, xMin, xMax, buckets) {
  // Slots: 0 = the point before the range, 1..buckets = the columns, buckets + 1 = the point after.
  const slots = buckets + 2;
  const width = (xMax - xMin) / buckets;
  const slotOf = (x) => (x < xMin ? 0 : x > xMax ? slots - 1 : 1 + Math.min(buckets - 1, Math.floor((x - xMin) / width)));
  const first = new Float64Array(slots).fill(Infinity);
  const last = new Float64Array(slots).fill(-Infinity);
  const perSeries = series.map((s, i) => {
    const min = new Float64Array(slots).fill(Infinity), max = new Float64Array(slots).fill(-Infinity);
    const minAt = new Float64Array(slots), maxAt = new Float64Array(slots);
    for (let j = spans[i][0]; j < spans[i][1]; j++) {
      const x = s.x[j], y = s.y[j], b = slotOf(x);
      if (x < first[b]) first[b] = x;
      if (x > last[b]) last[b] = x;
      if (!Number.isFinite(y)) continue;
      if (y < min[b]) { min[b] = y; minAt[b] = x; }
      if (y > max[b]) { max[b] = y; maxAt[b] = x; }
    }
    return {min, max, minAt, maxAt};
  });
  const xs = [];
  const ys = series.map(() => []);
  for (let b = 0; b < slots; b++) {
    if (first[b] === Infinity) continue;
    const two = last[b] > first[b];
    xs.push(first[b]);
    if (two) xs.push(last[b]);
    perSeries.forEach(({min, max, minAt, maxAt}, i) => {
      if (min[b] === Infinity) { ys[i].push(null); if (two) ys[i].push(null); return; }
      const minFirst = minAt[b] <= maxAt[b];
      const a = minFirst ? min[b] : max[b], z = minFirst ? max[b] : min[b];
      ys[i].push(a);
      if (two) ys[i].push(z);
    });
  }
  return [xs, ...ys];
}
