// Submit a job from JSON. A 422 names the offending field ({code, message, field, errors}); the field's line is
// highlighted in the editor and in the field reference taken from /openapi.json (one schema per kind).

import {api} from "../api.js";
import {h, fill} from "../dom.js";
import {go} from "../router.js";
import {DRAFT_KEY} from "./job.js";

const MAP_KEYS = {messages: "messages", tags: {role_tag: "role", content_tag: "content", user_tag: "user",
  assistant_tag: "assistant", system_tag: "system"}};
const TINY_QWEN3 = {num_layers: 2, hidden_size: 64, ffn_hidden_size: 128, num_attention_heads: 4, group_query_attention: true,
  num_query_groups: 2, kv_channels: 16, qk_layernorm: true, padded_vocab_size: 151936, normalization: "RMSNorm",
  position_embedding_type: "rope", swiglu: true, disable_bias_linear: true};

/** Starting points that work on the demo data `make run` prepares (paths relative to the first data root). */
export const TEMPLATES = {
  "preprocess (demo data)": {
    kind: "preprocess", name: "demo-preprocess", input: "demo/intent_train.jsonl", tokenizer_name_or_path: "demo/qwen3-tokenizer",
    output_prefix: "demo/out/intent", tokenizer_type: "PretrainedFromHF", handler_name: "SharegptStyleInstructionHandler",
    prompt_type: "qwen3", enable_thinking: true, map_keys: MAP_KEYS,
  },
  "train (tiny model on the preprocessed demo)": {
    kind: "train", name: "demo-train-tiny", data_path: ["demo/out/intent"], split: "100,0,0", train_iters: 50, lr: 3e-3,
    lr_warmup_iters: 5, lr_decay_style: "cosine", seq_length: 128, micro_batch_size: 4, global_batch_size: 8,
    log_interval: 1, is_instruction_dataset: true, finetune: true, stage: "sft", ...TINY_QWEN3,
  },
};
TEMPLATES["pipeline: preprocess, then train on its output"] = {
  kind: "pipeline", name: "demo-pipeline", steps: [
    {name: "preprocess", spec: {...TEMPLATES["preprocess (demo data)"], name: undefined, output_prefix: "demo/out/pipeline"}},
    {name: "train", spec: {...TEMPLATES["train (tiny model on the preprocessed demo)"], name: undefined,
      data_path: ["${steps.preprocess.outputs.data_path}"]}},
  ],
};

export function renderSubmit(root) {
  const draft = sessionStorage.getItem(DRAFT_KEY);
  sessionStorage.removeItem(DRAFT_KEY);
  const editor = h("textarea", {id: "spec", spellcheck: false, wrap: "off", autocomplete: "off", "aria-label": "Job spec (JSON)"});
  editor.value = draft || JSON.stringify(Object.values(TEMPLATES)[0], null, 2);
  const backdrop = h("div", {class: "backdrop", "aria-hidden": "true"});
  const errors = h("div", {class: "errors", id: "submit-errors", role: "alert"});
  const reference = h("div", {class: "reference"});
  const key = h("input", {id: "idempotency-key", placeholder: "optional Idempotency-Key", autocomplete: "off", "aria-label": "Idempotency-Key (optional)"});
  const template = h("select", {id: "template", "aria-label": "Template", onchange: async () => {
    if (!template.value) return;
    const spec = structuredClone(TEMPLATES[template.value]);
    template.value = "";
    if (spec.kind === "train") spec.data_path = await latestPreprocessOutput() || spec.data_path;
    editor.value = JSON.stringify(spec, null, 2);
    clearErrors();
    showReference();
  }}, h("option", {value: ""}, "load a template…"), Object.keys(TEMPLATES).map((t) => h("option", {value: t}, t)));
  const button = h("button", {class: "primary", id: "submit", type: "submit"}, "Submit job");
  let schemas = null;

  function clearErrors() {
    fill(errors);
    highlight(null);
  }

  /** Mirror the editor's text behind it with one line marked. */
  function highlight(range) {
    const text = editor.value;
    if (!range) { fill(backdrop, `${text}\n`); editor.classList.remove("has-error"); return; }
    const start = text.lastIndexOf("\n", range[0] - 1) + 1;
    let end = text.indexOf("\n", range[0]);
    if (end < 0) end = text.length;
    fill(backdrop, text.slice(0, start), h("mark", {}, text.slice(start, end) || " "), `${text.slice(end)}\n`);
    editor.classList.add("has-error");
    syncScroll();
  }

  function syncScroll() {
    backdrop.scrollTop = editor.scrollTop;
    backdrop.scrollLeft = editor.scrollLeft;
  }

  function focusField(field, position) {
    const range = position !== undefined ? [position, position] : field ? locate(editor.value, field) : null;
    highlight(range);
    reference.querySelectorAll(".bad").forEach((el) => el.classList.remove("bad"));
    const top = field && field.split(".")[0];
    const row = top && reference.querySelector(`[data-field="${CSS.escape(top)}"]`);
    if (row) { row.classList.add("bad"); row.scrollIntoView({block: "nearest"}); }
    if (range) {
      editor.focus();
      editor.setSelectionRange(range[0], range[1]);
      const line = editor.value.slice(0, range[0]).split("\n").length - 1;
      editor.scrollTop = Math.max(0, line * lineHeight(editor) - editor.clientHeight / 3);
      syncScroll();
    }
  }

  function showErrors(list, positionOf = () => undefined) {
    fill(errors, h("ul", {}, list.map((e, i) => h("li", {dataset: {field: e.field || ""}},
      e.field ? h("button", {class: "link field", onclick: () => focusField(e.field, positionOf(e, i))}, e.field) : null,
      e.field ? ": " : null, e.field && e.message.startsWith(`${e.field}: `) ? e.message.slice(e.field.length + 2) : e.message))));
  }

  async function submit(event) {
    event.preventDefault();
    clearErrors();
    let body;
    try {
      body = JSON.parse(editor.value);
    } catch (err) {
      const pos = jsonErrorPosition(err, editor.value);
      showErrors([{field: null, message: `Not valid JSON: ${err.message}`}]);
      if (pos !== undefined) focusField(null, pos);
      return;
    }
    button.disabled = true;
    try {
      const headers = key.value.trim() ? {"Idempotency-Key": key.value.trim()} : {};
      const job = await api("/v1/jobs", {method: "POST", body, headers});
      go(`#/jobs/${job.id}`);
    } catch (err) {
      showErrors(err.errors.length ? err.errors : [{message: err.message, field: err.field}]);
      if (err.field) focusField(err.field);
    } finally {
      button.disabled = false;
    }
  }

  async function showReference() {
    try {
      schemas = schemas || (await api("/openapi.json")).components.schemas;
    } catch { return; }
    let kind;
    try { kind = JSON.parse(editor.value).kind; } catch { return; }
    const schema = Object.values(schemas).find((s) => s.properties?.kind?.const === kind || s.properties?.kind?.default === kind);
    if (!schema) { fill(reference, h("p", {class: "muted"}, `No schema for kind ${JSON.stringify(kind)}.`)); return; }
    const required = new Set(schema.required || []);
    fill(reference, h("h3", {}, `${kind} fields`), h("p", {class: "muted small"}, "Bold = required. Full schema: ", h("a", {href: "/docs"}, "/docs")),
      h("dl", {class: "fields"}, ordered(schema.properties, required).flatMap(([name, p]) => [
        h("dt", {dataset: {field: name}, class: required.has(name) ? "required" : ""}, name,
          h("span", {class: "muted small"}, ` ${typeLabel(p)}${"default" in p ? ` = ${JSON.stringify(p.default)}` : ""}`)),
        p.description ? h("dd", {class: "small"}, p.description) : null])));
  }

  editor.addEventListener("input", () => { if (editor.classList.contains("has-error")) highlight(null); else fill(backdrop, `${editor.value}\n`); });
  editor.addEventListener("scroll", syncScroll);
  editor.addEventListener("change", showReference);
  highlight(null);
  root.append(h("section", {class: "card submit"},
    h("div", {class: "toolbar"}, h("h2", {}, "Submit a job"), template),
    h("p", {class: "muted"}, "A job spec in JSON: `kind` picks the job type; the other fields are MindSpeed-LLM flags in snake_case. ",
      "Paths are relative to the server's first data root."),
    h("form", {onsubmit: submit, class: "submit-grid"},
      h("div", {class: "editor"}, backdrop, editor),
      reference,
      h("div", {class: "actions"}, key, button),
      errors)));
  showReference();
}

/** data_path of the newest succeeded preprocess job (train takes it as written, not relative to a data root). */
async function latestPreprocessOutput() {
  try {
    const page = await api("/v1/jobs", {params: {kind: "preprocess", state: "succeeded", limit: 1}});
    const path = page.data[0]?.result?.outputs?.data_path;
    return path ? [path] : null;
  } catch {
    return null;
  }
}

/** [start, end) of the key named by an API error field ("resources.nproc_per_node", "data_path.0"), or null. */
export function locate(text, field) {
  let from = 0, found = null, skip = 0;
  for (const part of field.split(".")) {
    // A list index k: the next key is looked for as its (k+1)-th occurrence ("steps.1.spec" = the second step's spec).
    if (/^\d+$/.test(part)) { skip = Number(part); continue; }
    const re = new RegExp(`"${part.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}"\\s*:`, "g");
    re.lastIndex = from;
    let m = re.exec(text);
    for (; m && skip > 0; skip--) m = re.exec(text);
    if (!m) break;
    found = [m.index, m.index + m[0].length - 1];
    from = re.lastIndex;
  }
  return found;
}

function jsonErrorPosition(err, text) {
  const pos = /position (\d+)/.exec(err.message);
  if (pos) return Number(pos[1]);
  const lc = /line (\d+) column (\d+)/.exec(err.message);
  if (!lc) return undefined;
  const lines = text.split("\n").slice(0, Number(lc[1]) - 1);
  return lines.reduce((n, l) => n + l.length + 1, 0) + Number(lc[2]) - 1;
}

/** kind, then required fields, then the rest in schema order (the kind's own flags before the common ones). */
function ordered(properties, required) {
  const rank = ([name]) => (name === "kind" ? 0 : required.has(name) ? 1 : 2);
  const common = new Set(["name", "resources", "metadata", "priority", "max_restarts", "start_deadline_s", "run_deadline_s"]);
  return Object.entries(properties).sort((a, b) => rank(a) - rank(b) || common.has(a[0]) - common.has(b[0]));
}

function typeLabel(p) {
  if (p.type) return p.type === "array" ? `${p.items?.type || "any"}[]` : p.type;
  if (p.anyOf) return [...new Set(p.anyOf.map(typeLabel))].join(" | ");
  if (p.enum) return p.enum.map((v) => JSON.stringify(v)).join(" | ");
  if (p.const !== undefined) return JSON.stringify(p.const);
  if (p.$ref) return p.$ref.split("/").pop();
  return "";
}

function lineHeight(el) {
  const lh = parseFloat(getComputedStyle(el).lineHeight);
  return Number.isFinite(lh) ? lh : 18;
}
