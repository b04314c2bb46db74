// Number, time and size formatting shared by the views and the charts.

export function num(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  if (typeof v !== "number") return String(v);
  if (!Number.isFinite(v)) return v > 0 ? "∞" : "-∞";
  if (Number.isInteger(v) && Math.abs(v) < 1e15) return v.toLocaleString("en-US");
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(3);
  return String(Number(v.toPrecision(5)));
}

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "—";
  seconds = Math.max(0, Math.round(seconds));
  const h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60), s = seconds % 60;
  if (h) return `${h}h ${m}m`;
  if (m) return `${m}m ${s}s`;
  return `${s}s`;
}

export function time(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? iso : d.toLocaleString("sv-SE").replace("T", " ");
}

export function ago(iso) {
  if (!iso) return "—";
  return `${duration((Date.now() - new Date(iso).getTime()) / 1000)} ago`;
}

/** Run time of a job: started -> finished (or now while it runs). */
export function runtime(job) {
  if (!job.started_at) return "—";
  const end = job.finished_at ? new Date(job.finished_at) : new Date();
  return duration((end - new Date(job.started_at)) / 1000);
}

/** What a result must say before its numbers: a run continued from another job's checkpoint (resume: "auto"), and
 * the engine's warnings (a run that trained 0 iterations). */
export function resultNotes(summary) {
  const notes = [];
  if (summary && summary.resumed_from_job) {
    notes.push(`Resumed from job ${summary.resumed_from_job}'s run at iteration ${summary.start_iteration ?? "?"} (resume: auto)`);
  }
  for (const warning of (summary && summary.warnings) || []) notes.push(`Warning: ${warning}`);
  return notes;
}
