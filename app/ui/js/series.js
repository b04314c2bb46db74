// Metric series kept in growable typed arrays (8 bytes per step and value), so a 100k-step job costs ~1.6 MB a
// series and appending is amortised O(1).

export class Series {
  constructor(name, rank) {
    this.name = name;
    this.rank = rank;  // null for a job-wide value
    this.display = "";  // a label other than "name rN" (the compare page names the run)
    this.x = new Float64Array(256);
    this.y = new Float64Array(256);
    this.t = new Float64Array(256);  // ms since the epoch when the point was recorded (NaN if unknown)
    this.n = 0;
    this.cuts = 0;
  }

  get key() { return seriesKey(this.name, this.rank); }
  get label() {
    if (this.display) return this.display;
    if (this.rank === null) return this.name;
    return this.name.startsWith("sys_") ? `${this.name.slice(4)} dev${this.rank}` : `${this.name} r${this.rank}`;
  }

  /** Append (step, value). A step at or before the last one means the job restarted from a checkpoint: the newer
   * attempt replaces the points from that step on (as TensorBoard purges orphaned steps). */
  push(step, value, time = NaN) {
    if (this.n && step <= this.x[this.n - 1]) {
      this.n = lowerBound(this.x, this.n, step);
      this.cuts += 1;  // derived caches (smoothing, extent) start over
    }
    if (this.n === this.x.length) {
      const grow = (a) => { const b = new Float64Array(a.length * 2); b.set(a); return b; };
      this.x = grow(this.x);
      this.y = grow(this.y);
      this.t = grow(this.t);
    }
    this.x[this.n] = step;
    this.t[this.n] = time;
    this.y[this.n] = value === null || value === undefined ? NaN : value;
    this.n += 1;
  }

  last() { return this.n ? this.y[this.n - 1] : NaN; }
}

export function seriesKey(name, rank) {
  return rank === null || rank === undefined ? name : `${name}@${rank}`;
}

/** First index i in x[0:n) with x[i] >= value (x sorted ascending). */
export function lowerBound(x, n, value) {
  let lo = 0, hi = n;
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    if (x[mid] < value) lo = mid + 1; else hi = mid;
  }
  return lo;
}

/** Every series of one job, keyed by name and rank; `version` changes on every write (charts redraw lazily). */
export class MetricStore {
  constructor() {
    this.series = new Map();
    this.version = 0;
    this.listeners = new Set();
  }

  /** One SSE metric message: {step, rank, time, metrics: {name: value}}. */
  add(step, rank, metrics, time) {
    // The server's times are UTC; one without an offset (SQLite drops it) is read as UTC too, not local time.
    const ms = time ? Date.parse(/[zZ]|[+-]\d\d:?\d\d$/.test(time) ? time : `${time}Z`) : NaN;
    for (const [name, value] of Object.entries(metrics)) {
      if (value !== null && typeof value !== "number") continue;  // only numbers are charted
      const key = seriesKey(name, rank);
      let s = this.series.get(key);
      if (!s) {
        s = new Series(name, rank ?? null);
        this.series.set(key, s);
      }
      s.push(step, value, ms);
    }
    this.version += 1;
  }

  changed() { this.listeners.forEach((fn) => fn()); }
  subscribe(fn) { this.listeners.add(fn); return () => this.listeners.delete(fn); }
  names() { return [...new Set([...this.series.values()].map((s) => s.name))]; }
}
