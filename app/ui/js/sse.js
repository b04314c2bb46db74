// The job's Server-Sent Events stream read with fetch(), not EventSource: fetch can send the bearer token in the
// Authorization header and our own Last-Event-ID on reconnect, so no credential ever goes into a URL (and into
// access logs) and the server needs no second way to authenticate. Reconnects resume after the last id seen.

const RETRY_MS = [500, 1000, 2000, 5000];

export class JobStream {
  /**
   * handlers.onBatch(messages): every message parsed from one network chunk, [{event, id, data}] (data parsed JSON);
   * handlers.onStatus(status): "connecting" | "live" | "reconnecting" | "ended" | "error";
   * handlers.onError(err): a non-retryable answer (401, 404).
   */
  constructor(url, token, handlers, lastEventId = null) {
    this.url = url;
    this.token = token;
    this.handlers = handlers;
    this.lastEventId = lastEventId;
    this.controller = new AbortController();
    this.stopped = false;
    this.ended = false;
  }

  start() {
    this.loop();
    return this;
  }

  stop() {
    this.stopped = true;
    this.controller.abort();
  }

  status(s) { this.handlers.onStatus?.(s); }

  async loop() {
    let failures = 0;
    while (!this.stopped && !this.ended) {
      this.status(failures ? "reconnecting" : "connecting");
      try {
        await this.readOnce();
        failures = 0;  // a clean close without "end" (server restart): reconnect, resuming after the last id
        if (!this.ended) await new Promise((r) => setTimeout(r, RETRY_MS[0]));
      } catch (err) {
        if (this.stopped) return;
        if (err.fatal) { this.status("error"); this.handlers.onError?.(err); return; }
        failures += 1;
        this.status("reconnecting");
        await new Promise((r) => setTimeout(r, RETRY_MS[Math.min(failures, RETRY_MS.length) - 1]));
      }
    }
    if (this.ended) this.status("ended");
  }

  async readOnce() {
    const headers = {Accept: "text/event-stream", Authorization: `Bearer ${this.token}`};
    if (this.lastEventId) headers["Last-Event-ID"] = this.lastEventId;
    const response = await fetch(this.url, {headers, signal: this.controller.signal, cache: "no-store"});
    if (!response.ok) {
      let body = {};
      try { body = await response.json(); } catch { /* not JSON */ }
      const err = new Error(body.message || `HTTP ${response.status}`);
      err.status = response.status;
      err.fatal = response.status >= 400 && response.status < 500;
      throw err;
    }
    this.status("live");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    const parser = new SseParser();
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      const messages = parser.push(value);
      if (!messages.length) continue;
      for (const m of messages) if (m.id) this.lastEventId = m.id;
      if (messages.some((m) => m.event === "end")) this.ended = true;
      this.handlers.onBatch(messages);
      if (this.ended) { this.controller.abort(); return; }
    }
  }
}

/** Incremental text/event-stream parser (the WHATWG rules we rely on: event, data, id fields; comments ignored). */
export class SseParser {
  constructor() {
    this.buffer = "";
    this.event = "";
    this.data = [];
    this.id = "";
  }

  push(text) {
    let input = this.buffer + text;
    // A chunk may end between the \r and \n of one line break: keep the \r so it is not read as two breaks.
    const carry = input.endsWith("\r") ? "\r" : "";
    if (carry) input = input.slice(0, -1);
    const lines = input.split(/\r\n|\r|\n/);
    this.buffer = lines.pop() + carry;  // an incomplete last line waits for the next chunk
    const out = [];
    for (const line of lines) {
      if (line === "") {
        if (this.data.length) {
          const raw = this.data.join("\n");
          let data;
          try { data = JSON.parse(raw); } catch { data = raw; }
          out.push({event: this.event || "message", id: this.id, data});
        }
        this.event = "";
        this.data = [];
        continue;
      }
      if (line.startsWith(":")) continue;  // keep-alive ping comment
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") this.event = value;
      else if (field === "data") this.data.push(value);
      else if (field === "id") this.id = value;
    }
    return out;
  }
}
