// Job detail: state (pending reason, error), progress and ETA, result summary, and tabs with live metric charts,
// logs, events, artifacts and the spec. One SSE stream feeds everything and resumes after its last id.

import {api, auth, TERMINAL} from "../api.js";
import {h, fill} from "../dom.js";
import {duration, num, resultNotes, runtime, time} from "../format.js";
import {setQuery, go} from "../router.js";
import {JobStream} from "../sse.js";
import {MetricStore} from "../series.js";
import {MetricsPanel} from "./metrics_panel.js";
import {ArtifactsPanel, CheckpointsPanel, EventsPanel, LogsPanel} from "./panels.js";
import {CompletionsPanel, hasCompletions} from "./completions.js";
import {renderSpec} from "./spec_panel.js";
import {errorBox, every, keyValues, stateBadge, viewFromQuery, viewToQuery} from "./widgets.js";

const TABS = ["metrics", "logs", "events", "checkpoints", "completions", "artifacts", "spec"];
export const DRAFT_KEY = "llmjobs.draft";

export function renderJob(root, {params: [jobId], query}) {
  const ui = {tab: TABS.includes(query.get("tab")) ? query.get("tab") : "metrics", stream: query.get("stream") || ""};
  const store = new MetricStore();
  const chartView = viewFromQuery(query);
  chartView.changed = () => saveQuery();
  const metrics = new MetricsPanel(store, chartView);
  const logs = new LogsPanel(ui.stream, (s) => { ui.stream = s; saveQuery(); }, jobId);
  const events = new EventsPanel();
  const openDraft = (spec) => { sessionStorage.setItem(DRAFT_KEY, JSON.stringify(spec, null, 2)); go("#/submit"); };
  const checkpoints = new CheckpointsPanel(store, openDraft);
  const artifacts = new ArtifactsPanel(jobId);
  const completions = new CompletionsPanel(jobId);  // stage grpo only (its tab is hidden for other jobs)
  const panels = {metrics: metrics.el, logs: logs.el, events: events.el, checkpoints: checkpoints.el,
    completions: completions.el, artifacts: artifacts.el, spec: h("div")};
  let job = null;
  let progress = null;  // the last progress event's data {done, total, unit}
  let stopped = false;

  const head = h("div", {class: "job-head"});
  const overview = h("div", {class: "overview"});
  const live = h("span", {class: "live", id: "stream-status"});
  const tabBar = h("nav", {class: "tabs", "aria-label": "Job sections"},
    // completions starts hidden: refresh() shows it once the job is known to be a stage grpo run, so no other job's
    // page flashes a tab it does not have
    TABS.map((t) => h("button", {type: "button", dataset: {tab: t}, hidden: t === "completions", onclick: () => showTab(t)}, t)));
  const tabBody = h("div", {class: "tab-body"}, Object.values(panels));
  root.append(h("section", {class: "card"}, head, overview), h("section", {class: "card"}, h("div", {class: "tab-row"}, tabBar, live), tabBody));

  function saveQuery() { setQuery({tab: ui.tab === "metrics" ? "" : ui.tab, stream: ui.stream, ...viewToQuery(metrics.view)}); }

  function showTab(tab) {
    ui.tab = tab;
    saveQuery();
    tabBar.querySelectorAll("button").forEach((b) => {
      b.classList.toggle("active", b.dataset.tab === tab);
      b.setAttribute("aria-current", b.dataset.tab === tab ? "page" : "false");
    });
    for (const [name, el] of Object.entries(panels)) el.hidden = name !== tab;
    metrics.setVisible(tab === "metrics");
    if (tab === "artifacts") artifacts.load();
    if (tab === "completions") completions.load();
    if (tab === "logs") logs.scroll();
    if (tab === "checkpoints" && job) checkpoints.render(job);
  }

  async function refresh() {
    try {
      job = await api(`/v1/jobs/${jobId}`);
    } catch (err) {
      fill(head, h("a", {href: "#/jobs"}, "‹ Jobs"), errorBox(err));
      return;
    }
    renderHead();
    renderOverview();
    tabBar.querySelector('[data-tab="completions"]').hidden = !hasCompletions(job);
    if (job.kind === "pipeline") metrics.empty.textContent = "A pipeline's metrics, logs and artifacts belong to its steps' jobs (linked above).";
    renderSpec(panels.spec, job, h("button", {onclick: () => openDraft(job.spec)}, "Edit & resubmit"));
    checkpoints.render(job);
  }

  let armedUntil = 0;  // two clicks within 4 s cancel, so a stray click never cancels a day of training
  function renderHead() {
    const armed = () => Date.now() < armedUntil;
    const cancel = h("button", {class: "danger", id: "cancel", hidden: TERMINAL.has(job.state) || job.state === "cancelling"},
      armed() ? "Click again to cancel" : "Cancel job");
    cancel.addEventListener("click", async () => {
      if (!armed()) {
        armedUntil = Date.now() + 4000;
        cancel.textContent = "Click again to cancel";
        setTimeout(() => { if (!armed()) cancel.textContent = "Cancel job"; }, 4100);
        return;
      }
      armedUntil = 0;
      cancel.disabled = true;
      try { job = await api(`/v1/jobs/${jobId}/cancel`, {method: "POST"}); renderHead(); renderOverview(); } catch (err) { head.append(errorBox(err)); }
    });
    fill(head,
      h("a", {href: "#/jobs", class: "muted"}, "‹ Jobs"),
      h("div", {class: "title-row"},
        h("h2", {}, job.name || job.id), stateBadge(job.state), h("span", {class: "kind"}, job.kind), h("span", {class: "spacer"}), cancel),
      h("div", {class: "muted mono small"}, job.id));
  }

  function renderOverview() {
    const facts = {
      team: job.team, created: time(job.created_at), started: time(job.started_at), finished: time(job.finished_at),
      "run time": runtime(job), host: job.host || "—", attempts: `${job.attempt_count} of ${job.max_restarts + 1}`,
      priority: job.priority, "run dir": job.run_dir,
    };
    if (Object.keys(job.metadata || {}).length) facts.metadata = Object.entries(job.metadata).map(([k, v]) => `${k}=${v}`).join(", ");
    fill(overview,
      job.pending_reason && !TERMINAL.has(job.state) ? h("div", {class: "notice", id: "pending-reason"}, h("b", {}, "Waiting: "), job.pending_reason) : null,
      job.error ? h("div", {class: "failure", id: "job-error"}, h("b", {}, job.error.code), job.error.message ? `: ${job.error.message}` : "",
        job.error.log_tail ? h("details", {open: true}, h("summary", {}, "last log lines"), h("pre", {class: "log small"}, job.error.log_tail)) : null) : null,
      job.parent_id ? h("p", {}, "Step of pipeline ", h("a", {href: `#/jobs/${job.parent_id}`, class: "mono"}, job.parent_id)) : null,
      progressBar(),
      job.steps ? stepsTable(job.steps) : null,
      h("div", {class: "overview-grid"}, keyValues(facts), job.result ? resultBox(job.result) : null));
  }

  function stepsTable(steps) {
    return h("table", {class: "steps", id: "pipeline-steps"},
      h("thead", {}, h("tr", {}, ["Step", "Kind", "State", "Job"].map((t) => h("th", {}, t)))),
      h("tbody", {}, steps.map((step) => h("tr", {dataset: {step: step.name}},
        h("td", {}, step.name), h("td", {}, step.kind),
        h("td", {}, stateBadge(step.state), step.reason ? h("div", {class: "muted small"}, step.reason) : null),
        h("td", {}, step.job_id ? h("a", {href: `#/jobs/${step.job_id}`, class: "mono small"}, step.job_id) : "—")))));
  }

  function progressBar() {
    let done = null, total = null, unit = "", eta = null;
    const step = metrics.lastStep();
    if (job.kind === "train" && job.spec.train_iters && step !== null) {
      done = step; total = job.spec.train_iters; unit = "iterations";
      const it = store.series.get("iteration_time_ms");
      if (it && it.n && !TERMINAL.has(job.state)) {
        let sum = 0, k = 0;
        for (let i = Math.max(0, it.n - 20); i < it.n; i++) if (Number.isFinite(it.y[i])) { sum += it.y[i]; k++; }
        if (k) eta = ((total - done) * sum) / k / 1000;
      }
    } else if (progress && progress.done !== undefined) {
      ({done, total, unit} = progress);
    }
    if (done === null) return null;
    if (job.state === "succeeded" && total) done = total;
    const pct = total ? Math.min(100, (100 * done) / total) : null;
    return h("div", {class: "progress", id: "progress"},
      h("div", {class: "bar"}, h("div", {class: "fill", style: {width: `${pct ?? 100}%`}})),
      h("span", {}, `${num(done)}${total ? ` / ${num(total)}` : ""} ${unit || ""}`, pct !== null ? ` (${pct.toFixed(0)}%)` : "",
        eta !== null ? ` · ETA ${duration(eta)}` : ""));
  }

  function resultBox(result) {
    const summary = result.summary || {};
    const headline = ["accuracy", "exact_match", "loss", "perplexity", "final_lm_loss", "mean_tokens_per_s", "samples_written", "tokens"]
      .filter((k) => typeof summary[k] === "number");
    const simple = Object.fromEntries(Object.entries(summary).filter(([, v]) => v === null || typeof v !== "object"));
    return h("div", {class: "result", id: "result"},
      h("h3", {}, "Result"),
      resultNotes(summary).map((note) => h("div", {class: "notice result-note", dataset: {note: "resume"}}, note)),
      headline.length ? h("div", {class: "latest"}, headline.map((k) => h("div", {class: "stat big"}, h("span", {class: "muted"}, k), h("b", {}, num(summary[k]))))) : null,
      keyValues(simple, (v) => (typeof v === "number" ? num(v) : String(v)), "cols4"),
      Object.entries(summary).filter(([, v]) => v !== null && typeof v === "object").map(([k, v]) => nestedBlock(k, v)),
      Object.keys(result.outputs || {}).length ? keyValues(result.outputs, (v) => h("span", {class: "mono small"}, v)) : null);
  }

  /** A nested summary entry: a list of records or a map of records as a table (eval's confusion, per_label),
   * anything else as compact key-values. */
  function nestedBlock(key, value) {
    const records = Array.isArray(value) ? value.map((r) => ({...r}))
      : Object.values(value).every((v) => v && typeof v === "object" && !Array.isArray(v))
        ? Object.entries(value).map(([name, r]) => ({[key === "per_label" ? "label" : "key"]: name, ...r})) : null;
    const cell = (v) => (typeof v === "number" ? num(v) : typeof v === "object" && v !== null ? JSON.stringify(v) : String(v ?? "—"));
    let body;
    if (records && records.length && records.every((r) => r && typeof r === "object")) {
      const columns = [...new Set(records.flatMap((r) => Object.keys(r)))];
      body = h("table", {class: "summary-table"}, h("thead", {}, h("tr", {}, columns.map((c) => h("th", {}, c)))),
        h("tbody", {}, records.slice(0, 100).map((r) => h("tr", {}, columns.map((c) => h("td", {}, cell(r[c])))))));
    } else if (Array.isArray(value)) {
      body = h("p", {class: "muted"}, value.length ? value.map(cell).join(", ") : "none");
    } else {
      body = keyValues(value, cell);
    }
    return h("details", {class: "nested", open: key === "per_label" || key === "confusion", dataset: {key}}, h("summary", {}, key), body);
  }

  // Stream handling: all messages of one network chunk at once, then one redraw.
  let refreshTimer = 0;
  const refreshSoon = () => { clearTimeout(refreshTimer); refreshTimer = setTimeout(refresh, 200); };
  function onBatch(messages) {
    const newLogs = [], newEvents = [];
    let stateChanged = false, ended = false;
    for (const m of messages) {
      if (m.event === "metric") store.add(m.data.step, m.data.rank, m.data.metrics, m.data.time);
      else if (m.event === "log") newLogs.push(m.data);
      else if (m.event === "event" || m.event === "state") {
        newEvents.push(m.data);
        if (m.event === "state") stateChanged = true;
        if (m.data.type === "progress") progress = m.data.data;
      } else if (m.event === "end") ended = true;
    }
    if (newLogs.length) logs.add(newLogs);
    if (newEvents.length) {
      events.add(newEvents);
      checkpoints.add(newEvents);
      if (job && newEvents.some((e) => e.type === "checkpoint")) checkpoints.render(job);
    }
    metrics.changed();
    if (job && (messages.some((m) => m.event === "metric") || newEvents.length)) {
      const bar = progressBar(), old = overview.querySelector("#progress");
      if (bar && old) old.replaceWith(bar); else if (bar) renderOverview();
    }
    if (stateChanged || ended) refreshSoon();
    if (ended && ui.tab === "artifacts") artifacts.load();
  }

  const statusText = {connecting: "connecting…", live: "● live", reconnecting: "reconnecting…", ended: "job finished", error: "stream error"};
  const stream = new JobStream(`/v1/jobs/${encodeURIComponent(jobId)}/stream`, auth.token, {
    onBatch,
    onStatus: (s) => { live.textContent = statusText[s] || s; live.dataset.status = s; },
    onError: (err) => live.append(" ", err.message),
  });

  showTab(ui.tab);
  refresh().then(() => { if (!stopped) stream.start(); });
  // Pending reasons and heartbeats change without a stream message: re-read the job while it is not finished.
  const stopPoll = every(5000, () => (job && !TERMINAL.has(job.state) ? refresh() : null));
  return () => {
    stopped = true;
    stream.stop();
    stopPoll();
    clearTimeout(refreshTimer);
    metrics.destroy();
  };
}
