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

/** Per series and column: the index range of its points in that column (edges below; shared by the series with the
 * same steps, as a smoothed line and its raw twin), then its min and max from the cached block summaries it spans
 * plus the few points at its edges (summary below). No closure or property read in the inner loops. */
function bucketed(series, spans, xMin, xMax, buckets) {
  // Slots: 0 = the point before the range, 1..buckets = the columns, buckets + 1 = the point after.
  const slots = buckets + 2;
  const width = (xMax - xMin) / buckets;
  const first = new Float64Array(slots).fill(Infinity);
  const last = new Float64Array(slots).fill(-Infinity);
  const shared = new Map();  // x array -> {lo, hi, ends}
  const perSeries = series.map((s, i) => {
    const [lo, hi] = spans[i];
    let e = shared.get(s.x);
    if (!e || e.lo !== lo || e.hi !== hi) {
      e = {lo, hi, ends: edges(s.x, lo, hi, xMin, xMax, width, buckets)};
      shared.set(s.x, e);
    }
    return scan(s.x, s.y, summary(s), lo, e.ends, buckets, first, last);
  });
  let count = 0;
  for (let b = 0; b < slots; b++) if (first[b] !== Infinity) count += last[b] > first[b] ? 2 : 1;
  const xs = new Array(count);
  const ys = series.map(() => new Array(count));
  let k = 0;
  for (let b = 0; b < slots; b++) {
    if (first[b] === Infinity) continue;
    const two = last[b] > first[b];
    xs[k] = first[b];
    if (two) xs[k + 1] = last[b];
    for (let i = 0; i < perSeries.length; i++) {
      const {min, max, minFirst} = perSeries[i], out = ys[i];
      if (min[b] === Infinity) { out[k] = null; if (two) out[k + 1] = null; continue; }
      out[k] = minFirst[b] ? min[b] : max[b];
      if (two) out[k + 1] = minFirst[b] ? max[b] : min[b];
    }
    k += two ? 2 : 1;
  }
  return [xs, ...ys];
}

const BLOCK = 16;

/** The finite min and max of each complete block of BLOCK values (and the index of each), cached on the series and
 * extended as it grows; started over when its values were reallocated or a restart cut it. A column of a 100k-point
 * series on a 1,000 px chart spans ~100 points: ~6 block reads and ~16 edge points instead of 100 reads. */
function summary(s) {
  let c = s.blockCache;
  if (!c || c.y !== s.y || c.cuts !== s.cuts || c.blocks * BLOCK > s.n) {
    const cap = Math.ceil(s.y.length / BLOCK);
    c = {y: s.y, cuts: s.cuts, blocks: 0, min: new Float64Array(cap), max: new Float64Array(cap),
      minAt: new Int32Array(cap), maxAt: new Int32Array(cap)};
    s.blockCache = c;
  }
  const y = s.y, full = Math.floor(s.n / BLOCK);
  for (let k = c.blocks; k < full; k++) {
    let mn = Infinity, mx = -Infinity, mnAt = k * BLOCK, mxAt = k * BLOCK;
    for (let i = k * BLOCK, end = i + BLOCK; i < end; i++) {
      const v = y[i];
      if (v < mn && v !== -Infinity) { mn = v; mnAt = i; }
      if (v > mx && v !== Infinity) { mx = v; mxAt = i; }
    }
    c.min[k] = mn; c.max[k] = mx; c.minAt[k] = mnAt; c.maxAt[k] = mxAt;
  }
  c.blocks = full;
  return c;
}

/** ends[b]: the first index in [lo, hi) past slot b's steps (slot 0 ends at xMin, the last slot at hi). */
function edges(x, lo, hi, xMin, xMax, width, buckets) {
  const slots = buckets + 2, ends = new Int32Array(slots);
  let j = lo;
  for (let b = 0; b < slots; b++) {
    j = b === slots - 1 ? hi
      : b === 0 ? seek(x, j, hi, BEFORE_MIN, xMin, xMin, width)
        : b === buckets ? seek(x, j, hi, UP_TO_MAX, xMax, xMin, width)
          : seek(x, j, hi, IN_COLUMN_BEFORE, b, xMin, width);
    ends[b] = j;
  }
  return ends;
}

/** One series' finite min and max per slot (and which came first), widening first/last to its steps per slot. */
function scan(x, y, blocks, lo, ends, buckets, first, last) {
  const slots = buckets + 2;
  const bMin = blocks.min, bMax = blocks.max, bMinAt = blocks.minAt, bMaxAt = blocks.maxAt;
  const min = new Float64Array(slots).fill(Infinity), max = new Float64Array(slots).fill(-Infinity);
  const minFirst = new Uint8Array(slots);
  let j = lo;
  for (let b = 0; b < slots; b++) {
    const end = ends[b];
    if (end === j) continue;
    if (x[j] < first[b]) first[b] = x[j];
    if (x[end - 1] > last[b]) last[b] = x[end - 1];
    let mn = Infinity, mx = -Infinity, mnAt = 0, mxAt = 0;
    // Whole blocks inside [j, end) come from the summary; the points before and after them are read one by one.
    // Strict comparisons keep the first index of equal extremes, as one pass over every point would.
    const k0 = Math.ceil(j / BLOCK), k1 = Math.floor(end / BLOCK);
    const head = k1 > k0 ? k0 * BLOCK : end;
    for (let i = j; i < head; i++) {
      const v = y[i];  // NaN fails both comparisons: gaps never count
      if (v < mn && v !== -Infinity) { mn = v; mnAt = i; }
      if (v > mx && v !== Infinity) { mx = v; mxAt = i; }
    }
    if (k1 > k0) {
      for (let k = k0; k < k1; k++) {
        if (bMin[k] < mn) { mn = bMin[k]; mnAt = bMinAt[k]; }
        if (bMax[k] > mx) { mx = bMax[k]; mxAt = bMaxAt[k]; }
      }
      for (let i = k1 * BLOCK; i < end; i++) {
        const v = y[i];
        if (v < mn && v !== -Infinity) { mn = v; mnAt = i; }
        if (v > mx && v !== Infinity) { mx = v; mxAt = i; }
      }
    }
    min[b] = mn;
    max[b] = mx;
    minFirst[b] = mnAt <= mxAt ? 1 : 0;
    j = end;
  }
  return {min, max, minFirst};
}

// What seek looks for: the first index past the points with x < xMin, with x <= xMax, or in a column before b
// (floor((x - xMin) / width) < b: the very test that puts a point in a column).
const BEFORE_MIN = 0, UP_TO_MAX = 1, IN_COLUMN_BEFORE = 2;

function before(x, i, kind, v, xMin, width) {
  return kind === BEFORE_MIN ? x[i] < v : kind === UP_TO_MAX ? x[i] <= v : (x[i] - xMin) / width < v;
}

/** First index i in [lo, hi) where `before` turns false (it is true then false along sorted x), else hi. Steps are
 * usually evenly spaced, so the index is guessed by interpolation and the guess corrected by galloping: a couple of
 * reads a column instead of a binary search's 17 over a 100k-point series. */
function seek(x, lo, hi, kind, v, xMin, width) {
  if (lo >= hi) return lo;
  const target = kind === IN_COLUMN_BEFORE ? xMin + v * width : v, x0 = x[lo], x1 = x[hi - 1];
  let guess = x1 > x0 ? lo + Math.floor(((target - x0) / (x1 - x0)) * (hi - 1 - lo)) : lo;
  guess = Math.min(hi - 1, Math.max(lo, guess));
  let yes, no;  // before(yes) holds (or yes = lo - 1), before(no) does not (or no = hi)
  if (before(x, guess, kind, v, xMin, width)) {
    yes = guess;
    let step = 1;
    no = guess + 1;
    while (no < hi && before(x, no, kind, v, xMin, width)) { yes = no; step *= 2; no = guess + step; }
    no = Math.min(no, hi);
  } else {
    no = guess;
    let step = 1;
    yes = guess - 1;
    while (yes >= lo && !before(x, yes, kind, v, xMin, width)) { no = yes; step *= 2; yes = guess - step; }
    yes = Math.max(yes, lo - 1);
  }
  while (no - yes > 1) {
    const mid = (yes + no) >>> 1;
    if (before(x, mid, kind, v, xMin, width)) yes = mid; else no = mid;
  }
  return no;
}
