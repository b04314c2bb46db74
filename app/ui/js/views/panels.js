// The job page's logs (with server-side search and "first error"), events (filtered by type, progress folded by
// default), checkpoints and artifacts panels.

import {api} from "../api.js";
import {h, fill} from "../dom.js";
import {bytes, num, time} from "../format.js";
import {errorBox} from "./widgets.js";

const KEEP_LINES = 20000;  // per stream in the page; older lines stay available over GET /logs?offset=

/** Log lines per stream ("launcher" = every rank's output as the launcher saw it, "rank0", "rank1", ...). */
export class LogsPanel {
  constructor(initialStream, onStreamChange, jobId = null) {
    this.jobId = jobId;
    this.lines = new Map();
    this.dropped = new Map();
    this.current = initialStream || "";
    this.onStreamChange = onStreamChange;
    this.select = h("select", {id: "log-stream", "aria-label": "Log stream (rank)", onchange: () => this.show(this.select.value)});
    this.follow = h("input", {type: "checkbox", id: "log-follow", checked: true});
    this.pre = h("pre", {class: "log", role: "log", tabindex: 0, "aria-label": "Log lines"});
    this.note = h("span", {class: "muted small"});
    this.query = h("input", {type: "search", id: "log-search", placeholder: "search this stream", "aria-label": "Search the log (server side)"});
    this.hits = h("div", {class: "log-hits", id: "log-hits", "aria-live": "polite"});
    const form = h("form", {class: "inline", role: "search", onsubmit: (e) => { e.preventDefault(); this.search(this.query.value); }},
      this.query, h("button", {type: "submit"}, "Search"));
    this.el = h("div", {class: "logs-panel"},
      h("div", {class: "toolbar"}, h("label", {class: "inline", for: "log-stream"}, "Stream ", this.select),
        h("label", {class: "inline"}, this.follow, " follow"), form,
        h("button", {type: "button", id: "log-first-error", onclick: () => this.firstError()}, "First error"), this.note),
      this.hits, this.pre);
    this.pre.addEventListener("scroll", () => {
      // Scrolling up pauses following; scrolling back to the bottom resumes it.
      const atBottom = this.pre.scrollTop + this.pre.clientHeight >= this.pre.scrollHeight - 4;
      this.follow.checked = atBottom;
    });
    this.refreshChoices();
  }

  /** New log messages from the stream: [{stream, seq, text, time}]. */
  add(batch) {
    let appended = "";
    let newStream = false;
    for (const line of batch) {
      let list = this.lines.get(line.stream);
      if (!list) { list = []; this.lines.set(line.stream, list); newStream = true; }
      list.push(line.text);
      if (line.stream === this.current) appended += `${line.text}\n`;
    }
    for (const [stream, list] of this.lines) {
      if (list.length > KEEP_LINES * 1.2) {
        const cut = list.length - KEEP_LINES;
        list.splice(0, cut);
        this.dropped.set(stream, (this.dropped.get(stream) || 0) + cut);
        if (stream === this.current) { this.show(stream); appended = ""; }
      }
    }
    if (newStream) this.refreshChoices();
    if (!this.current && this.lines.size) { this.show(this.defaultStream()); return; }
    if (appended) {
      this.pre.append(appended);
      this.scroll();
    }
  }

  defaultStream() {
    return this.lines.has("launcher") ? "launcher" : [...this.lines.keys()].sort()[0];
  }

  refreshChoices() {
    const streams = [...this.lines.keys()].sort((a, b) => (a === "launcher" ? -1 : b === "launcher" ? 1 : a.localeCompare(b, "en", {numeric: true})));
    if (this.current && !streams.includes(this.current)) streams.push(this.current);
    fill(this.select, streams.length ? streams.map((s) => h("option", {value: s}, s === "launcher" ? "all ranks (launcher)" : s.replace(/^rank/, "rank ")))
      : h("option", {value: ""}, "no logs yet"));
    this.select.value = this.current;
  }

  show(stream) {
    this.current = stream;
    this.select.value = stream;
    this.onStreamChange?.(stream);
    const list = this.lines.get(stream) || [];
    this.pre.textContent = list.length ? `${list.join("\n")}\n` : "";
    const dropped = this.dropped.get(stream) || 0;
    this.note.textContent = dropped ? `${dropped} earlier lines not shown (GET /v1/jobs/{id}/logs?stream=${stream}&offset=0)` : "";
    this.scroll();
  }

  scroll() {
    if (this.follow.checked) this.pre.scrollTop = this.pre.scrollHeight;
  }

  /** Lines of the current stream containing `text`, searched by the server (the page keeps only the newest lines). */
  async search(text, limit = 200) {
    text = text.trim();
    if (!text) { fill(this.hits); return []; }
    let page;
    try {
      page = await api(`/v1/jobs/${encodeURIComponent(this.jobId)}/logs`, {params: {stream: this.current || "launcher", q: text, limit}});
    } catch (err) {
      fill(this.hits, errorBox(err));
      return [];
    }
    fill(this.hits, h("p", {class: "muted small"}, `${page.data.length}${page.has_more ? "+" : ""} lines contain “${text}”`,
      h("button", {type: "button", class: "link small", onclick: () => fill(this.hits)}, " clear")),
    page.data.length ? h("ol", {class: "hits mono small"}, page.data.map((line) => h("li", {dataset: {seq: line.seq}},
      h("button", {type: "button", class: "link", onclick: () => this.reveal(line.seq)}, `line ${line.seq + 1}`), " ", line.text))) : null);
    return page.data;
  }

  /** The first line that looks like an error (a Python traceback, else "error"), found by the server. */
  async firstError() {
    const found = [];
    for (const needle of ["Traceback", "error"]) {
      const page = await api(`/v1/jobs/${encodeURIComponent(this.jobId)}/logs`, {params: {stream: this.current || "launcher", q: needle, limit: 1}});
      if (page.data.length) found.push(page.data[0]);
    }
    found.sort((a, b) => a.seq - b.seq);
    if (!found.length) { fill(this.hits, h("p", {class: "muted small", id: "no-error"}, "No error in this stream.")); return; }
    fill(this.hits, h("p", {class: "small"}, `First error at line ${found[0].seq + 1}: `, h("span", {class: "mono"}, found[0].text)));
    this.reveal(found[0].seq);
  }

  /** Scroll the log to line `seq` (0-based) and mark it, when the page holds it. */
  reveal(seq) {
    const list = this.lines.get(this.current) || [];
    const index = seq - (this.dropped.get(this.current) || 0);
    if (index < 0 || index >= list.length) return false;
    this.follow.checked = false;
    const before = list.slice(0, index).join("\n"), after = list.slice(index + 1).join("\n");
    const mark = h("mark", {id: "log-mark", tabindex: -1}, list[index]);
    this.pre.replaceChildren(before ? `${before}\n` : "", mark, `\n${after}${after ? "\n" : ""}`);
    mark.scrollIntoView({block: "center"});
    mark.focus({preventScroll: true});
    return true;
  }
}

/** Events with a type filter: one checkbox per type seen (with its count); `progress` starts unticked, since a
 * long job's hundreds of progress events would bury the few checkpoints and warnings. */
export class EventsPanel {
  constructor() {
    this.body = h("tbody");
    this.count = 0;
    this.types = new Map();  // type -> count
    this.shown = new Set();
    this.folded = new Set(["progress"]);
    this.filters = h("fieldset", {class: "event-types", id: "event-types"}, h("legend", {}, "Types"));
    this.el = h("div", {class: "events-panel"}, this.filters,
      h("table", {class: "events"}, h("thead", {}, h("tr", {}, ["Time", "Level", "Type", "Message", "Data"].map((t) => h("th", {scope: "col"}, t)))), this.body));
  }

  /** Events and state changes from the stream: [{id, type, level, message, data, time}]. */
  add(batch) {
    const rows = batch.map((e) => h("tr", {class: `level-${e.level}`, dataset: {type: e.type}, hidden: this.folded.has(e.type)},
      h("td", {class: "nowrap"}, time(e.time)), h("td", {}, e.level), h("td", {}, e.type), h("td", {}, e.message),
      h("td", {class: "mono small"}, Object.keys(e.data || {}).length ? JSON.stringify(e.data) : "")));
    this.body.append(...rows);
    this.count += rows.length;
    for (const e of batch) this.types.set(e.type, (this.types.get(e.type) || 0) + 1);
    this.renderFilters();
  }

  renderFilters() {
    const boxes = [...this.types.entries()].sort(([a], [b]) => a.localeCompare(b)).map(([type, n]) => {
      const box = h("input", {type: "checkbox", value: type, checked: !this.folded.has(type), onchange: () => this.toggle(type, box.checked)});
      return h("label", {class: "inline", dataset: {type}}, box, ` ${type} (${n})`);
    });
    fill(this.filters, h("legend", {}, "Types"), boxes);
  }

  toggle(type, on) {
    if (on) this.folded.delete(type); else this.folded.add(type);
    for (const tr of this.body.children) tr.hidden = this.folded.has(tr.dataset.type);
  }
}

/** Saved training checkpoints (the job's `checkpoint` events) with the metrics at their iteration, and actions
 * that pre-fill the submit form: evaluate it, convert it to Hugging Face, or (until the API serves files) a convert
 * job whose output is a downloadable HF directory. */
export class CheckpointsPanel {
  constructor(store, onDraft) {
    this.store = store;
    this.onDraft = onDraft;
    this.saved = [];  // [{iteration, path, time}]
    this.job = null;
    this.el = h("div", {class: "checkpoints-panel"}, h("p", {class: "muted"}, "No checkpoint saved yet (train jobs save every save_interval iterations and at the end when `save` is set)."));
  }

  add(events) {
    for (const e of events) {
      if (e.type !== "checkpoint" || e.data?.iteration === undefined) continue;
      this.saved = this.saved.filter((c) => c.iteration !== e.data.iteration);  // a retry saves the same iteration again
      this.saved.push({iteration: e.data.iteration, path: e.data.path || "", time: e.time});
    }
    this.saved.sort((a, b) => a.iteration - b.iteration);
  }

  valueAt(name, iteration) {
    const s = this.store.series.get(name);
    if (!s) return null;
    for (let i = s.n - 1; i >= 0; i--) if (s.x[i] <= iteration) return s.x[i] === iteration ? s.y[i] : null;
    return null;
  }

  render(job) {
    this.job = job;
    if (!this.saved.length) return;
    const metrics = ["lm_loss", "validation_loss", "grad_norm"].filter((n) => this.store.series.has(n));
    fill(this.el, h("table", {class: "checkpoints", id: "checkpoints"},
      h("thead", {}, h("tr", {}, ["Iteration", ...metrics, "Saved", "Path", "Actions"].map((t) => h("th", {scope: "col"}, t)))),
      h("tbody", {}, this.saved.map((c) => h("tr", {dataset: {iteration: c.iteration}},
        h("td", {}, String(c.iteration)), metrics.map((m) => h("td", {}, num(this.valueAt(m, c.iteration)))),
        h("td", {class: "nowrap"}, time(c.time)), h("td", {class: "mono small"}, c.path),
        h("td", {class: "actions"},
          h("button", {type: "button", class: "small", dataset: {action: "evaluate"}, onclick: () => this.onDraft(this.draft("evaluate", c))}, "Evaluate"),
          h("button", {type: "button", class: "small", dataset: {action: "convert"}, onclick: () => this.onDraft(this.draft("convert", c))}, "Convert"),
          h("button", {type: "button", class: "small", dataset: {action: "download"}, onclick: () => this.onDraft(this.draft("download", c))},
            "Download as HF")))))));
  }

  /** The spec the submit form opens with. The checkpoint is named by reference ({job, iteration}): the API puts
   * its path in (and, for LoRA adapters, the run's base model in `load` with the adapters in `lora_load`). Metadata
   * values are strings (the API's labels). */
  draft(action, c) {
    const spec = this.job.spec;
    const base = `${this.job.name || this.job.id.slice(0, 8)}-iter${c.iteration}`;
    const ref = {job: this.job.id, iteration: c.iteration};
    const from = {from_job: this.job.id, from_iteration: String(c.iteration)};
    const model = {};
    for (const k of ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention", "num_query_groups",
      "kv_channels", "qk_layernorm", "padded_vocab_size", "normalization", "position_embedding_type", "swiglu", "disable_bias_linear",
      "seq_length", "tokenizer_name_or_path"]) if (spec[k] !== undefined && spec[k] !== null) model[k] = spec[k];
    if (action === "evaluate") {
      return {kind: "eval", name: `${base}-eval`, load: ref, eval_data_path: "<test set .jsonl under a data root>",
        eval_mode: "generate", ...model, metadata: from};
    }
    return {kind: "convert", name: `${base}-${action === "download" ? "hf-download" : "convert"}`, load_model_type: "mg",
      save_model_type: "hf", load_dir: ref, save_dir: `${spec.save}-hf-iter${c.iteration}`,
      metadata: {...from, ...(action === "download" ? {purpose: "download"} : {})}};
  }
}

export class ArtifactsPanel {
  constructor(jobId) {
    this.jobId = jobId;
    this.el = h("div", {class: "artifacts-panel"}, h("p", {class: "muted"}, "Loading…"));
  }

  async load() {
    try {
      const page = await api(`/v1/jobs/${this.jobId}/artifacts`);
      fill(this.el, page.data.length ? h("table", {class: "artifacts"},
        h("thead", {}, h("tr", {}, ["Output", "Path", "Size", "Files"].map((t) => h("th", {}, t)))),
        h("tbody", {}, page.data.map((a) => h("tr", {},
          h("td", {}, a.name), h("td", {class: "mono small"}, a.path), h("td", {}, bytes(a.size_bytes)),
          h("td", {}, h("details", {}, h("summary", {}, `${a.files.length} files`),
            h("ul", {class: "mono small"}, a.files.map((f) => h("li", {}, f))))))))) :
        h("p", {class: "muted"}, "No artifacts yet: they are recorded from result.json when the job succeeds."));
    } catch (err) {
      fill(this.el, errorBox(err));
    }
  }
}
