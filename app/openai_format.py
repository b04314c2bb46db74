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
import secrets
import time
from typing import Any

from app.openai_tools import ToolError, call_grammar, check_tools, chosen, split_tool_calls
from engine.contract.serve_request import (
    BOOL,
    INTEGER,
    LIST,
    OBJECT,
    OPTION_FIELDS,
    OPTION_KINDS,
    STRING,
    STRINGS,
    Kind,
    RequestError,
    SamplingOptions,
    ServeRequest,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
__all__ = ["split_tool_calls"]  # re-exported: the whole-answer parser lives with the streaming one
# The serving request's options passed as they are (``engine.contract.serve_request.SamplingOptions``: a field added
# there is accepted here); ``max_tokens`` and ``logprobs`` have OpenAI's own spellings (below).
SAMPLING_FIELDS = tuple(name for name in OPTION_FIELDS if name not in ("max_tokens", "logprobs"))
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


def _is_stream_options(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("include_usage", False), bool)


# The JSON type of every accepted field (null is taken as absent), the serving request's own for its options:
# checked before anything reaches an engine, so a wrong type is a 400 naming its field, never a 500 halfway through
# an answer.
_TYPES: dict[str, Kind] = {
    **{name: OPTION_KINDS[name] for name in SAMPLING_FIELDS},
    **dict.fromkeys(("max_tokens", "max_completion_tokens", "top_logprobs"), INTEGER),
    "model": STRING,
    "user": STRING,
    "messages": LIST,
    "tools": LIST,
    "chat_template_kwargs": OBJECT,
    "response_format": OBJECT,
    "structured_outputs": OBJECT,
    "tool_choice": Kind("a string or an object", lambda v: isinstance(v, (str, dict))),
    "stream": BOOL,
    "stream_options": Kind('an object such as {"include_usage": true}', _is_stream_options),
    "logprobs": BOOL,  # chat's; /v1/completions takes an integer (below)
    "prompt": STRINGS,
}
_COMPLETION_TYPES = {**_TYPES, "logprobs": INTEGER}


def _refused(err: RequestError, param: str | None = None) -> OpenAIError:
    """The serving request's refusal in OpenAI's shape, naming ``param`` (the body's spelling of the field)."""
    param = param or err.field
    return OpenAIError(400, f"{param}: {err.detail}", param, err.code)


def _check_fields(body: dict[str, Any], allowed: set[str], types: dict[str, Kind]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise OpenAIError(400, f"{unknown[0]}: not supported by this server", unknown[0], "unsupported_parameter")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise OpenAIError(400, "model: required (a deployment's name, see GET /v1/models)", "model")
    for name in sorted(body):
        if body[name] is not None:
            try:
                types[name].check(name, body[name])
            except RequestError as err:
                raise _refused(err) from err


def _options(body: dict[str, Any], spelled: dict[str, str | None]) -> SamplingOptions:
    """The serving request's options of a checked body: ``SAMPLING_FIELDS`` as they are, and each option of
    ``spelled`` from the body's field it names (None: absent); a value out of range is a 400 naming that field."""
    values = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    values |= {name: body[field] for name, field in spelled.items() if field and body.get(field) is not None}
    try:
        return SamplingOptions.from_json(values)
    except RequestError as err:
        raise _refused(err, spelled.get(err.field)) from err


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


def chat_request(body: dict[str, Any]) -> ServeRequest:
    """The serving request of a ``/v1/chat/completions`` body."""
    _check_fields(body, CHAT_FIELDS, _TYPES)
    max_tokens = next((n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None), None)
    values = {**body, "top_logprobs": body.get("top_logprobs") or 0}  # read only when logprobs is true
    options = _options(values, {"max_tokens": max_tokens, "logprobs": "top_logprobs" if body.get("logprobs") else None})
    mode = tool_mode(body)
    forced = None if mode in ("none", "auto") else call_grammar(check_tools(body["tools"]), mode)
    grammar = structured(body, forced)
    return ServeRequest(
        options=options,
        messages=body.get("messages"),
        tools=body["tools"] if mode != "none" else None,  # tool_choice none: the tools are not shown to the model
        chat_template_kwargs=body.get("chat_template_kwargs"),
        structured=grammar[1] if grammar is not None else None,
    )


def completion_request(body: dict[str, Any]) -> ServeRequest:
    """The serving request of a ``/v1/completions`` body (one prompt string; OpenAI's default max_tokens 16)."""
    _check_fields(body, COMPLETION_FIELDS, _COMPLETION_TYPES)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise OpenAIError(400, "prompt: one string is supported", "prompt")
    values = {**body, "max_tokens": 16 if body.get("max_tokens") is None else body["max_tokens"]}
    options = _options(values, {"max_tokens": "max_tokens", "logprobs": "logprobs"})
    grammar = structured(body)
    return ServeRequest(options=options, prompt=prompt, structured=grammar[1] if grammar is not None else None)


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
