// Chat with the team's deployments (GET /v1/models, POST /v1/chat/completions streamed as SSE): pick a deployment or
// one of its adapters, set a system prompt, thinking and sampling, and read the answer as it streams, its thought
// apart. "Compare" adds a second panel: the same message goes to both models at once, each keeping its own
// conversation, to set two checkpoints side by side. The picks live in the URL (#/chat?models=a,b).

import {ApiError, api, auth} from "../api.js";
import {h, fill} from "../dom.js";
import {setQuery} from "../router.js";
import {errorMessage, feed, newAnswer} from "../openai_stream.js";
import {errorBox} from "./widgets.js";

export function renderChat(root, {query}) {
  const aborter = new AbortController();
  const picks = (query.get("models") || "").split(",").filter(Boolean);
  const controls = {
    system: h("textarea", {id: "chat-system", rows: 2, placeholder: "System prompt (optional)", "aria-label": "System prompt"}),
    thinking: h("input", {id: "chat-thinking", type: "checkbox", checked: query.get("thinking") !== "0"}),
    temperature: h("input", {id: "chat-temperature", type: "number", min: 0, max: 2, step: 0.1, value: query.get("temperature") || "0.7"}),
    topP: h("input", {id: "chat-top-p", type: "number", min: 0.01, max: 1, step: 0.05, value: "1"}),
    // empty: each deployment generates up to its own max_model_len (prompt included), read from its spec below
    maxTokens: h("input", {id: "chat-max-tokens", type: "number", min: 1, step: 1, value: "", placeholder: "up to max_model_len"}),
    compare: h("input", {id: "chat-compare", type: "checkbox", checked: picks.length > 1}),
    message: h("textarea", {id: "chat-message", rows: 3, placeholder: "Message (Ctrl+Enter sends)", "aria-label": "Message"}),
  };
  const status = h("div", {class: "status"});
  const panelsEl = h("div", {class: "chat-panels"});
  const send = h("button", {id: "chat-send", class: "primary", onclick: () => sendAll()}, "Send");
  const clearBtn = h("button", {id: "chat-clear", onclick: () => panels.forEach((p) => p.clear())}, "New conversation");
  const label = (text, el) => h("label", {class: "inline"}, text, " ", el);
  root.append(h("section", {class: "card"},
    h("h2", {}, "Chat"),
    status,
    controls.system,
    h("div", {class: "toolbar"},
      label("Thinking", controls.thinking), label("Temperature", controls.temperature),
      label("top_p", controls.topP), label("Max tokens", controls.maxTokens), label("Compare two models", controls.compare)),
    panelsEl,
    controls.message,
    h("div", {class: "toolbar"}, send, clearBtn)));

  let models = [];
  const panels = [];

  function remember() {
    setQuery({models: panels.map((p) => p.select.value).filter(Boolean).join(","),
              thinking: controls.thinking.checked ? "" : "0", temperature: controls.temperature.value});
  }

  function layout() {
    const want = controls.compare.checked ? 2 : 1;
    while (panels.length < want) panels.push(makePanel(panels.length, picks[panels.length], models, remember));
    while (panels.length > want) panels.pop();
    fill(panelsEl, panels.map((p) => p.el));
    remember();
  }

  function sendAll() {
    const text = controls.message.value.trim();
    if (!text || panels.some((p) => p.busy)) return;
    const options = {
      system: controls.system.value.trim(),
      thinking: controls.thinking.checked,
      temperature: Number(controls.temperature.value),
      top_p: Number(controls.topP.value),
      max_tokens: controls.maxTokens.value ? Number(controls.maxTokens.value) : undefined,
    };
    controls.message.value = "";
    panels.forEach((p) => p.ask(text, options, aborter.signal));
  }

  controls.compare.addEventListener("change", layout);
  for (const el of [controls.thinking, controls.temperature]) el.addEventListener("change", remember);
  controls.message.addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) sendAll(); });

  (async () => {
    try {
      models = (await api("/v1/models", {signal: aborter.signal})).data || [];
      await readLimits(models, aborter.signal);
    } catch (err) {
      if (err.name !== "AbortError") fill(status, errorBox(err));
      return;
    }
    fill(status, models.length ? h("span", {class: "muted"}, `${models.length} model${models.length === 1 ? "" : "s"} ready`)
      : h("p", {class: "muted"}, "No deployment is ready: submit a serve job (kind \"serve\") and wait for it to run."));
    layout();
  })();
  return () => aborter.abort();
}

/** Each model's ``maxModelLen``, from its deployment's effective spec (GET /v1/jobs/{job_id}/effective-spec); a
 * deployment whose spec cannot be read keeps none (the engine still answers 400 past its length). */
async function readLimits(models, signal) {
  const jobs = [...new Set(models.map((m) => m.job_id).filter(Boolean))];
  const limits = new Map();
  await Promise.all(jobs.map(async (id) => {
    try {
      const rows = (await api(`/v1/jobs/${encodeURIComponent(id)}/effective-spec`, {signal})).data;
      const row = rows.find((r) => r.field === "max_model_len");
      if (row && typeof row.value === "number") limits.set(id, row.value);
    } catch { /* left without a limit */ }
  }));
  for (const m of models) m.maxModelLen = limits.get(m.job_id) ?? null;
}

/** ``max_tokens`` for ``model``: the one asked for, never above the model's max_model_len. */
export function maxTokensFor(model, asked) {
  if (asked === undefined || !model?.maxModelLen) return asked;
  return Math.min(asked, model.maxModelLen);
}

/** One model's conversation: its picker, its turns, and the request that streams its next answer. */
function makePanel(index, picked, models, onPick) {
  const select = h("select", {class: "chat-model", dataset: {panel: String(index)}, onchange: onPick, "aria-label": `Model ${index + 1}`},
    models.map((m) => h("option", {value: m.id, selected: m.id === picked},
      (m.parent ? `${m.id} (adapter of ${m.parent})` : m.id) + (m.maxModelLen ? ` · ${m.maxModelLen} tokens` : ""))));
  const log = h("div", {class: "chat-log", dataset: {panel: String(index)}});
  const note = h("div", {class: "muted small chat-note"});
  const history = [];
  const panel = {
    select, busy: false,
    el: h("div", {class: "chat-panel"}, select, log, note),
    clear() { history.length = 0; fill(log); fill(note); },
    async ask(text, options, signal) {
      panel.busy = true;
      const turn = [...history, {role: "user", content: text}];
      log.append(h("div", {class: "chat-msg user"}, text));
      const thought = h("pre", {class: "chat-thought"});
      const details = h("details", {class: "chat-thinking", hidden: true}, h("summary", {}, "Thought"), thought);
      const content = h("div", {class: "chat-content"});
      const bubble = h("div", {class: "chat-msg assistant"}, details, content);
      log.append(bubble);
      const started = performance.now();
      let first = null;
      try {
        const model = models.find((m) => m.id === select.value);
        const limited = {...options, max_tokens: maxTokensFor(model, options.max_tokens)};
        const answer = await stream(select.value, turn, limited, signal, (a) => {
          if (first === null && (a.content || a.reasoning)) first = performance.now() - started;
          details.hidden = !a.reasoning;
          thought.textContent = a.reasoning;
          content.textContent = a.content;
          log.scrollTop = log.scrollHeight;
        });
        history.push(turn[turn.length - 1], {role: "assistant", content: answer.content});
        const used = answer.usage ? `${answer.usage.completion_tokens} tokens` : "";
        fill(note, [used, first === null ? "" : `first token ${Math.round(first)} ms`, answer.finish || ""].filter(Boolean).join(" · "));
      } catch (err) {
        if (err.name === "AbortError") return;
        bubble.classList.add("error");
        content.textContent = err.message;  // the failed turn is not kept: the next message starts from the last answer
      } finally {
        panel.busy = false;
      }
    },
  };
  return panel;
}

/** POST the conversation with stream: true; ``onUpdate(answer)`` after every network chunk; the whole answer. */
async function stream(model, turn, options, signal, onUpdate) {
  const messages = options.system ? [{role: "system", content: options.system}, ...turn] : turn;
  const body = {
    model, messages, stream: true, stream_options: {include_usage: true},
    temperature: options.temperature, top_p: options.top_p, max_tokens: options.max_tokens,
    chat_template_kwargs: {enable_thinking: options.thinking},
  };
  const response = await fetch("/v1/chat/completions", {
    method: "POST", signal, body: JSON.stringify(body),
    headers: {"Content-Type": "application/json", Accept: "text/event-stream", Authorization: `Bearer ${auth.token}`},
  });
  if (!response.ok) {
    let detail = null;
    try { detail = await response.json(); } catch { /* not JSON: the status says it */ }
    throw new ApiError(response.status, {message: errorMessage(response.status, detail)});
  }
  const answer = newAnswer();
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer = feed(answer, buffer + decoder.decode(value, {stream: true}));
    onUpdate(answer);
  }
  return answer;
}
