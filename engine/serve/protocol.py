"""The engine's internal request protocol: a JSON request in, JSON lines out (``engine.serve.server`` speaks it, the
API's OpenAI routes translate to and from it).

Request (``POST /v1/generate``), one prompt of:
    ``messages`` (chat turns, rendered with the deployment's ``prompt_type`` template, ``chat_template_kwargs``'s
    ``enable_thinking`` switching Qwen3's thinking; ``tools``, a list of tool definitions, rendered as Qwen3 does),
    ``prompt`` (text, tokenized as is) or ``prompt_token_ids``;
plus the sampling fields (``stop`` a string or a list), ``model``: one of the deployment's LoRA adapters
(``lora_adapters``), else (absent, or the served name) the base, and ``structured``: a grammar every sampled token
keeps to (``engine.serve.structured``: ``json_schema``, ``regex``, ``choice`` or ``lark``): the fields, JSON types,
ranges and defaults of ``engine.contract.serve_request.ServeRequest``, the one type the API and a remote eval build.
``POST /tokenize`` takes ``messages`` or ``prompt`` (with ``chat_template_kwargs``, ``tools``, ``model``) and answers
vLLM's ``{"count", "max_model_len", "tokens"}``; ``POST /detokenize`` takes ``{"tokens": [ids]}`` and answers
``{"prompt": text}``.
Response lines: ``{"type": "start", "prompt_tokens": N}``, then per token ``{"type": "token", "index": i, "token_id",
"text" (the new text; held back while it may still become a stop string), and with ``logprobs`` ``"token_text"``,
``"logprob"``, ``"top_logprobs": [{"token_id", "text", "logprob"}]}``, per choice
``{"type": "finish", "index": i, "finish_reason", "completion_tokens"}``, last ``{"type": "done", "usage": {...}}``;
``{"type": "keepalive"}`` lines while a request waits (readers skip them).
Errors before the stream: ``{"error": {"message", "field", "type"}}`` with 400 (bad request, a wrong type included),
404 (``model`` names no adapter here), 429 (queue full, ``Retry-After`` header), 500 (``engine_error``: the request
failed before its first token) or 503 (``engine_unavailable``: the batching loop has ended, ``Retry-After``).
An error after the stream began is its last line, ``{"type": "error", "error": {"message", "field", "type"}}``,
with no ``done`` (``engine.serve.server``).
"""

from __future__ import annotations

import json
from typing import Any

from engine.contract.serve_request import PROMPT_FIELDS, RequestError, ServeRequest
from engine.data.templates import ConversationError, encode_prompt
from engine.serve.sampling import RequestOptions
from engine.serve.structured import StructuredError, grammar_of

TOKENIZE_FIELDS = {"messages", "prompt", "chat_template_kwargs", "tools", "model"}


class BadRequest(Exception):
    """A request the engine refuses (400, or ``status``), naming the field at fault."""

    def __init__(self, message: str, field: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.field, self.status = field, status


def adapter_index(body: dict[str, Any], served_name: str, adapters: dict[str, int]) -> int:
    """The adapter the body's ``model`` chooses (0: the base); a name this deployment does not serve is a 404."""
    model = body.get("model")
    if model is None or model == served_name:
        return 0
    if isinstance(model, str) and model in adapters:
        return adapters[model]
    have = ", ".join([served_name, *adapters])
    raise BadRequest(f"model: {model!r} is not served here (it serves {have})", field="model", status=404)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_request(body: dict[str, Any]) -> ServeRequest:
    """A generation body as the contract's ``ServeRequest``: an unknown field, a wrong type or a value out of range
    is a 400 naming the field (never a default, never a crash further on)."""
    try:
        return ServeRequest.from_json(body)
    except RequestError as err:
        raise BadRequest(str(err), field=err.field) from err


def parse_options(body: dict[str, Any]) -> RequestOptions:
    """The sampling options of a request body (the whole body checked, ``parse_request``)."""
    return RequestOptions.of(parse_request(body).options)


def _text_content(content: Any, where: str) -> str:
    """OpenAI message content: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest(f"{where}.content: only text content is supported", field="messages")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body["messages"]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages: must be a non-empty list", field="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}]: must be an object with a role", field="messages")
        out.append({"role": m["role"], "content": _text_content(m.get("content"), f"messages[{i}]")})
    tools = body.get("tools")
    if tools:
        at = 1 if out[0]["role"] == "system" else 0
        out.insert(at, {"role": "tools", "content": json.dumps(tools, ensure_ascii=False)})
    return out


def _thinking(body: dict[str, Any]) -> str:
    """Qwen3's default is to think (as its HF chat template and vLLM): absent means true."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs: must be an object", field="chat_template_kwargs")
    value = kwargs.get("enable_thinking", True)
    if not isinstance(value, bool):
        raise BadRequest("chat_template_kwargs.enable_thinking: must be true or false", field="chat_template_kwargs")
    return "true" if value else "false"


def thinking(body: dict[str, Any]) -> bool:
    """Whether a chat request's answer may open with a thought (Qwen3's ``enable_thinking``, true by default)."""
    return body.get("messages") is not None and _thinking(body) == "true"


def structured_grammar(body: dict[str, Any]) -> str | None:
    """The llguidance grammar of the body's ``structured`` field (None: free text); a bad one is a 400 naming it."""
    if body.get("structured") is None:
        return None
    try:
        return grammar_of(body["structured"])
    except StructuredError as err:
        raise BadRequest(str(err), field="structured") from err


def tokenize_body(body: dict[str, Any]) -> None:
    """A ``/tokenize`` body has only ``TOKENIZE_FIELDS`` (its prompt is read by ``prompt_ids``)."""
    unknown = sorted(set(body) - TOKENIZE_FIELDS)
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown field", field=unknown[0])
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise BadRequest(f"tools: must be a list, got {_shown(body['tools'])}", field="tools")


def detokenize_ids(body: dict[str, Any], vocab_size: int) -> list[int]:
    """The ``tokens`` of a ``/detokenize`` body: a list of ids in the vocabulary."""
    unknown = sorted(set(body) - {"tokens", "model"})
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown field", field=unknown[0])
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest("tokens: must be a list of token ids", field="tokens")
    if not all(0 <= t < vocab_size for t in ids):
        raise BadRequest(f"tokens: ids must be in [0, {vocab_size})", field="tokens")
    return ids


def prompt_ids(body: dict[str, Any], tokenizer: Any, template: str, vocab_size: int) -> list[int]:
    """The prompt's token ids from whichever of ``messages`` / ``prompt`` / ``prompt_token_ids`` the body has."""
    given = [k for k in PROMPT_FIELDS if body.get(k) is not None]
    if len(given) != 1:
        raise BadRequest("messages: give exactly one of messages, prompt or prompt_token_ids", field="messages")
    if given[0] == "messages":
        try:
            ids = encode_prompt(tokenizer, _messages(body), template, _thinking(body))
        except (ConversationError, ValueError) as err:
            raise BadRequest(f"messages: {err}", field="messages") from err
    elif given[0] == "prompt":
        if not isinstance(body["prompt"], str):
            raise BadRequest("prompt: must be a string", field="prompt")
        ids = list(tokenizer(body["prompt"], add_special_tokens=False)["input_ids"])
    else:
        ids = body["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise BadRequest(f"prompt_token_ids: must be a list of ids in [0, {vocab_size})", field="prompt_token_ids")
    if not ids:
        raise BadRequest(f"{given[0]}: the prompt is empty", field=given[0])
    return ids


class Detokenizer:
    """Turns one choice's tokens into text deltas: holds back an incomplete UTF-8 character and, while stop strings
    are asked for, the tail that could still become one; cuts the text at the first stop string.

    Incremental, as vLLM's ``detokenize_incrementally``: each token decodes only the ids since the last two complete
    characters' boundaries (``_prefix``, ``_read``), not the whole output (every push decoding all of it cost 351 µs
    per token over a 1,024-token output, 12 µs so); the window starts at a token boundary on both sides of the
    difference, so tokenizers that strip a leading space (Metaspace) cut the same way as a full decode."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # the text of ids[:_read]: ends on a complete character
        self._prefix = self._read = 0

    def push(self, token: int) -> str:
        """The new text after ``token`` (possibly empty); sets ``stopped`` when a stop string appeared."""
        self.ids.append(token)
        text = self._decoded()
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.stopped = True
                return self._send(text, at)
        if text.endswith("\ufffd"):
            return ""
        return self._send(text, len(text) - self._hold)

    def flush(self) -> str:
        """What was held back, once the choice ended without a stop string."""
        if self.stopped:
            return ""
        text = self._decoded()
        return self._send(text, len(text))

    def _decoded(self) -> str:
        """The text of all ``ids`` so far, decoding only the window from ``_prefix`` on."""
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        window = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=True)
        text = self._text + window[len(before) :]
        if len(window) > len(before) and not window.endswith("\ufffd"):  # a complete character: the window moves on
            self._text, self._prefix, self._read = text, self._read, len(self.ids)
        return text

    def _send(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = text[self.sent : upto], upto
        return delta
