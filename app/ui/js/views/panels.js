// The job page's logs, events and artifacts panels.

import {api} from "../api.js";
import {h, fill} from "../dom.js";
import {bytes, time} from "../format.js";
import {errorBox} from "./widgets.js";

const KEEP_LINES = 20000;  // per stream in the page; older lines stay available over GET /logs?offset=

/** Log lines per stream ("launcher" = every rank's output as the launcher saw it, "rank0", "rank1", ...). */
export class LogsPanel {
  constructor(initialStream, onStreamChange) {
    this.lines = new Map();
    this.dropped = new Map();
    this.current = initialStream || "";
    this.onStreamChange = onStreamChange;
    this.select = h("select", {id: "log-stream", onchange: () => this.show(this.select.value)});
    this.follow = h("input", {type: "checkbox", id: "log-follow", checked: true});
    this.pre = h("pre", {class: "log", tabindex: 0});
    this.note = h("span", {class: "muted small"});
    this.el = h("div", {class: "logs-panel"},
      h("div", {class: "toolbar"}, h("label", {class: "inline"}, "Stream ", this.select),
        h("label", {class: "inline"}, this.follow, " follow"), this.note),
      this.pre);
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
}

export class EventsPanel {
  constructor() {
    this.body = h("tbody");
    this.count = 0;
    this.el = h("div", {class: "events-panel"},
      h("table", {class: "events"}, h("thead", {}, h("tr", {}, ["Time", "Level", "Type", "Message", "Data"].map((t) => h("th", {}, t)))), this.body));
  }

  /** Events and state changes from the stream: [{id, type, level, message, data, time}]. */
  add(batch) {
    const rows = batch.map((e) => h("tr", {class: `level-${e.level}`, dataset: {type: e.type}},
      h("td", {class: "nowrap"}, time(e.time)), h("td", {}, e.level), h("td", {}, e.type), h("td", {}, e.message),
      h("td", {class: "mono small"}, Object.keys(e.data || {}).length ? JSON.stringify(e.data) : "")));
    this.body.append(...rows);
    this.count += rows.length;
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
