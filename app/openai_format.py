"""OpenAI's wire format for the serving routes: requests to the engine's internal protocol, its JSON lines back to
chat / text completion objects and stream chunks, and OpenAI's error shape.

Thinking: a Qwen3 answer that opens with ``<think>`` has its thought, up to ``</think>``, returned as
``reasoning_content`` and the rest as ``content`` (vLLM's ``qwen3`` reasoning parser convention); an answer without
the opening tag (``enable_thinking: false``) is all content, less any stray ``</think>`` (a template that opened the
thought in the prompt): that tag never reaches ``content``. Tool calls: ``app.openai_tools``.

Structured output: ``response_format`` (OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}``; ``text`` is free) or vLLM's ``structured_outputs`` extra body field
(one of ``choice``, ``regex``, ``json``) becomes the engine's ``structured`` grammar, enforced while decoding whatever
``strict`` says; a missing schema is a 400 naming ``response_format``, a schema the engine cannot compile a 400
naming the field it came from.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

from app.openai_tools import ToolError, call_grammar, check_tools, chosen, split_tool_calls

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
__all__ = ["split_tool_calls"]  # re-exported: the whole-answer parser lives with the streaming one
# Fields passed to the engine as they are (``engine.serve.sampling.RequestOptions``); OpenAI's defaults apply when
# absent (temperature 1, top_p 1).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
CHAT_FIELDS = {
    *SAMPLING_FIELDS,
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "user",
    "response_format",
    "structured_outputs",
}
COMPLETION_FIELDS = {
    *SAMPLING_FIELDS,
    *("model", "prompt", "stream", "stream_options", "max_tokens", "logprobs", "user"),
    *("response_format", "structured_outputs"),
}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error"}


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, **headers: str):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "rate_limit_error" if self.status == 429 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)  # json.loads reads NaN and Infinity


def _is_strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _is_stream_options(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("include_usage", False), bool)


_NUMBER, _INT = (_is_number, "a finite number"), (_is_int, "an integer")
_STRING, _BOOL = ((lambda v: isinstance(v, str)), "a string"), ((lambda v: isinstance(v, bool)), "true or false")
_OBJECT, _LIST = ((lambda v: isinstance(v, dict)), "an object"), ((lambda v: isinstance(v, list)), "a list")
# The JSON type of every accepted field (null is taken as absent): checked before anything reaches an engine, so a
# wrong type is a 400 naming its field, never a 500 halfway through an answer.
_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"), _NUMBER),
    **dict.fromkeys(("top_k", "seed", "n", "max_tokens", "max_completion_tokens", "top_logprobs"), _INT),
    "stop": ((lambda v: isinstance(v, str) or _is_strings(v)), "a string or a list of strings"),
    "model": _STRING,
    "user": _STRING,
    "messages": _LIST,
    "tools": _LIST,
    "chat_template_kwargs": _OBJECT,
    "response_format": _OBJECT,
    "structured_outputs": _OBJECT,
    "tool_choice": ((lambda v: isinstance(v, (str, dict))), "a string or an object"),
    "stream": _BOOL,
    "stream_options": (_is_stream_options, 'an object such as {"include_usage": true}'),
    "logprobs": _BOOL,  # chat's; /v1/completions takes an integer (below)
    "prompt": ((lambda v: isinstance(v, str) or _is_strings(v)), "a string or a list of strings"),
}
_COMPLETION_TYPES = {**_TYPES, "logprobs": _INT}


def _check_fields(body: dict[str, Any], allowed: set[str], types: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise OpenAIError(400, f"{unknown[0]}: not supported by this server", unknown[0], "unsupported_parameter")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise OpenAIError(400, "model: required (a deployment's name, see GET /v1/models)", "model")
    for name in sorted(body):
        ok, kind = types[name]
        if body[name] is not None and not ok(body[name]):
            raise OpenAIError(400, f"{name}: must be {kind}, got {body[name]!r:.80}", name, "invalid_type")


def _given(body: dict[str, Any], *names: str) -> Any:
    """The first of ``names`` the body sets (not null), else None."""
    return next((body[n] for n in names if body.get(n) is not None), None)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param, "invalid_value")


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind != "json_schema":
        raise _bad("response_format", "type must be text, json_object or json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise _bad("response_format", "json_schema.schema: required, a JSON schema object")
    if not isinstance(spec.get("strict", False), bool | None):
        raise _bad("response_format", "json_schema.strict: must be true or false")
    return {"json_schema": spec["schema"]}


def _structured_outputs(value: dict[str, Any]) -> dict[str, Any]:
    given = [k for k in ("choice", "regex", "json") if value.get(k) is not None]
    if len(given) != 1 or set(value) - {"choice", "regex", "json"}:
        raise _bad("structured_outputs", "give exactly one of choice, regex or json")
    arg = value[given[0]]
    if given[0] == "json":
        arg = json.loads(arg) if isinstance(arg, str) else arg  # vLLM takes the schema as an object or its text
        return {"json_schema": arg}
    return {given[0]: arg}


def structured(body: dict[str, Any], tool_grammar: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """(the field it came from, the engine's ``structured`` value) of a checked body, or None: free text. At most
    one of ``response_format`` (not text), ``structured_outputs`` and a forced tool call."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.get("response_format") is not None and (fmt := _response_format(body["response_format"])) is not None:
        found.append(("response_format", fmt))
    if body.get("structured_outputs") is not None:
        try:
            found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
        except ValueError as err:
            raise _bad("structured_outputs", f"json: not JSON: {err}") from err
    if tool_grammar is not None:
        found.append(("tool_choice", {"lark": tool_grammar}))
    if len(found) > 1:
        raise _bad(found[1][0], f"cannot be combined with {found[0][0]}")
    return found[0] if found else None


def tool_mode(body: dict[str, Any]) -> str:
    """What the body's ``tool_choice`` asks of its ``tools`` (``app.openai_tools.chosen``), checked."""
    try:
        return chosen(body.get("tool_choice"), check_tools(body.get("tools") or [])) or "none"
    except ToolError as err:
        raise OpenAIError(400, str(err), err.param, "invalid_value") from err


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The engine request of a ``/v1/chat/completions`` body."""
    _check_fields(body, CHAT_FIELDS, _TYPES)
    out = {**_sampling(body), "messages": body.get("messages")}
    max_tokens = _given(body, "max_completion_tokens", "max_tokens")
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    if body.get("logprobs"):
        out["logprobs"] = body.get("top_logprobs") or 0
    if body.get("chat_template_kwargs") is not None:
        out["chat_template_kwargs"] = body["chat_template_kwargs"]
    mode = tool_mode(body)
    if mode != "none":  # tool_choice none: the tools are not shown to the model
        out["tools"] = body["tools"]
    forced = None if mode in ("none", "auto") else call_grammar(check_tools(body["tools"]), mode)
    grammar = structured(body, forced)
    if grammar is not None:
        out["structured"] = grammar[1]
    return out


def completion_request(body: dict[str, Any]) -> dict[str, Any]:
    """The engine request of a ``/v1/completions`` body (one prompt string)."""
    _check_fields(body, COMPLETION_FIELDS, _COMPLETION_TYPES)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise OpenAIError(400, "prompt: one string is supported", "prompt")
    max_tokens = _given(body, "max_tokens")
    out = {**_sampling(body), "prompt": prompt, "max_tokens": 16 if max_tokens is None else max_tokens}
    if body.get("logprobs") is not None:
        out["logprobs"] = body["logprobs"]
    grammar = structured(body)
    if grammar is not None:
        out["structured"] = grammar[1]
    return out


def wants_stream(body: dict[str, Any]) -> bool:
    """Whether a checked body asks for SSE chunks."""
    return bool(body.get("stream"))


def include_usage(body: dict[str, Any]) -> bool:
    """Whether a checked streaming body asks for the usage chunk (``stream_options.include_usage``)."""
    return bool((body.get("stream_options") or {}).get("include_usage"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class ReasoningSplitter:
    """Splits one choice's text stream into (reasoning, content) deltas (see the module docstring)."""

    def __init__(self) -> None:
        self.state = "start"  # start -> reasoning -> content, or start -> content
        self.buffer = ""

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        reasoning = content = ""
        if self.state == "start":
            if self.buffer.startswith(THINK_OPEN):
                self.state, self.buffer = "reasoning", self.buffer[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(self.buffer) and not final:
                return "", ""  # could still become the opening tag
            else:
                self.state = "content"
        if self.state == "reasoning":
            at = self.buffer.find(THINK_CLOSE)
            if at != -1:
                reasoning, self.buffer = self.buffer[:at], self.buffer[at + len(THINK_CLOSE) :]
                self.state = "content"
            else:
                keep = 0 if final else _partial_suffix(self.buffer, THINK_CLOSE)
                reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        if self.state == "content":
            text = self.buffer.replace(THINK_CLOSE, "")  # a stray closing tag (see the module docstring)
            keep = 0 if final else _partial_suffix(text, THINK_CLOSE)
            content, self.buffer = text[: len(text) - keep], text[len(text) - keep :]
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back until the next delta decides)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def chat_logprobs(line: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs.content`` entry of one token line (None when logprobs were not asked for)."""
    if "logprob" not in line:
        return None

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    top = [entry(t["text"], t["logprob"]) for t in line.get("top_logprobs", [])]
    return {**entry(line.get("token_text", line["text"]), line["logprob"]), "top_logprobs": top}


def chunk(kind: str, rid: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices, **extra}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def structured_origin(body: dict[str, Any]) -> str:
    """The field of a body whose grammar the engine refused (see ``structured``)."""
    if body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict):
        return "tool_choice"
    return "structured_outputs" if body.get("structured_outputs") is not None else "response_format"
