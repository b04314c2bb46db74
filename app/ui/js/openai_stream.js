// OpenAI chat-completion streams as the API sends them (SSE "data: {chunk}" lines, "data: [DONE]" last), folded into
// one answer: content, the thought (reasoning_content), finish reason and usage. Pure (node tests it without a DOM).

/** A fresh answer: what the chunks have said so far. */
export function newAnswer() {
  return {content: "", reasoning: "", finish: null, usage: null, done: false, chunks: 0};
}

/** Split SSE text into complete events; returns {data: [payload strings], rest: the incomplete tail}. */
export function splitEvents(buffer) {
  const data = [];
  const parts = buffer.replace(/\r\n/g, "\n").split("\n\n");
  const rest = parts.pop();
  for (const event of parts) {
    const lines = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
    if (lines.length) data.push(lines.join("\n"));
  }
  return {data, rest};
}

/** Fold one chunk (a parsed JSON object) into ``answer`` (choice 0 only: the page asks for n = 1). */
export function applyChunk(answer, chunk) {
  answer.chunks += 1;
  if (chunk.usage) answer.usage = chunk.usage;
  const choice = (chunk.choices || []).find((c) => (c.index ?? 0) === 0);
  if (!choice) return answer;
  const delta = choice.delta || {};
  if (typeof delta.reasoning_content === "string") answer.reasoning += delta.reasoning_content;
  if (typeof delta.content === "string") answer.content += delta.content;
  if (choice.finish_reason) answer.finish = choice.finish_reason;
  return answer;
}

/** Feed raw stream text: complete events are applied, the tail is kept for the next call. Returns the new tail. */
export function feed(answer, buffer) {
  const {data, rest} = splitEvents(buffer);
  for (const payload of data) {
    if (payload.trim() === "[DONE]") { answer.done = true; continue; }
    applyChunk(answer, JSON.parse(payload));
  }
  return rest;
}

/** The message text of an OpenAI-shaped error body ({"error": {"message"}}), else of ours ({message}). */
export function errorMessage(status, body) {
  const detail = body && (body.error ? body.error.message : body.message);
  return detail ? `${status}: ${detail}` : `HTTP ${status}`;
}
