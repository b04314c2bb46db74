// A stage grpo job's completions (GET /v1/jobs/{id}/completions), a page at a time: every rollout's, or with an
// iteration, those of the rollout that iteration trained on. Each row: its prompt, its completion (cut ones marked),
// the weighted reward and each function's score ("—" where an http reward's batch failed), and its advantage.

import {api} from "../api.js";
import {h, fill} from "../dom.js";
import {num} from "../format.js";
import {errorBox} from "./widgets.js";

const PAGE = 50;
const PREVIEW = 120;  // characters of a prompt or completion shown before it is opened

/** Whether a job has completions to show: a stage grpo train job. */
export function hasCompletions(job) {
  return job.kind === "train" && job.spec && job.spec.stage === "grpo";
}

export class CompletionsPanel {
  constructor(jobId) {
    this.jobId = jobId;
    this.offset = 0;
    this.nextOffset = 0;
    this.step = h("input", {type: "number", min: 1, id: "completions-step", placeholder: "every rollout", "aria-label": "Iteration (the rollout it trained on)"});
    this.prev = h("button", {type: "button", id: "completions-prev", disabled: true, onclick: () => this.load(Math.max(0, this.offset - PAGE))}, "‹ Previous");
    this.next = h("button", {type: "button", id: "completions-next", disabled: true, onclick: () => this.load(this.nextOffset)}, "Next ›");
    this.note = h("span", {class: "muted small", id: "completions-note", "aria-live": "polite"});
    this.body = h("div", {class: "completions-body"});
    const form = h("form", {class: "inline", onsubmit: (e) => { e.preventDefault(); this.load(0); }},
      h("label", {class: "inline", for: "completions-step"}, "Iteration ", this.step), h("button", {type: "submit"}, "Show"));
    this.el = h("div", {class: "completions-panel"}, h("div", {class: "toolbar"}, form, this.prev, this.next, this.note), this.body);
  }

  async load(offset = this.offset) {
    const params = {offset, limit: PAGE, step: this.step.value || undefined};
    let page;
    try {
      page = await api(`/v1/jobs/${encodeURIComponent(this.jobId)}/completions`, {params});
    } catch (err) {
      fill(this.body, errorBox(err));
      return;
    }
    this.offset = offset;
    this.nextOffset = page.next_offset;
    this.prev.disabled = offset === 0;
    this.next.disabled = !page.has_more;
    this.note.textContent = page.data.length ? `completions ${offset + 1}–${offset + page.data.length}` : "";
    fill(this.body, page.data.length ? table(page.data)
      : h("p", {class: "muted"}, "No completions yet: each rollout writes its own."));
  }
}

function table(rows) {
  const keys = [...new Set(rows.flatMap((r) => Object.keys(r.rewards || {})))];
  return h("table", {class: "completions", id: "completions-table"},
    h("thead", {}, h("tr", {}, ["Iteration", "Prompt", "Completion", "Reward", ...keys, "Advantage"].map((t) => h("th", {}, t)))),
    h("tbody", {}, rows.map((r) => h("tr", {dataset: {prompt: r.prompt_id, iteration: r.iteration}},
      h("td", {}, num(r.iteration)),
      h("td", {class: "prompt"}, text(r.prompt ?? `row ${r.prompt_id} (${r.prompt_ids.length} tokens)`)),
      h("td", {class: "completion"}, text(r.completion), r.truncated ? h("span", {class: "badge", title: "cut at max_completion_length"}, "truncated") : null),
      h("td", {class: "num reward"}, num(r.reward)),
      keys.map((k) => h("td", {class: "num", dataset: {reward: k}}, num(r.rewards[k]))),
      h("td", {class: "num advantage"}, num(r.advantage))))));
}

/** A long text opened on demand: its first characters as the summary, all of it below. */
function text(value) {
  if (value.length <= PREVIEW) return h("span", {class: "mono small"}, value);
  return h("details", {class: "nested"}, h("summary", {class: "mono small"}, `${value.slice(0, PREVIEW)}…`),
    h("pre", {class: "log small"}, value));
}
