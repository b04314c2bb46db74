"""Qwen3 tool calls on the OpenAI routes (vLLM's ``hermes`` parser, which its ``qwen3_json`` aliases).

- ``tools``: OpenAI function tools, checked here (a bad one is a 400 naming ``tools``) and rendered by the engine's
  chat template (Qwen3's ``<tools>`` system block).
- ``tool_choice``: ``auto`` (the default with tools): the answer's ``<tool_call>{"name", "arguments"}</tool_call>``
  blocks become ``tool_calls``; ``none``: the tools are not rendered and nothing is parsed (the model cannot call one);
  ``required`` or ``{"type": "function", "function": {"name"}}``: the engine decodes within a grammar of one or more
  such blocks (one, for a named function) whose ``arguments`` follow the function's ``parameters`` schema
  (``engine.serve.structured``, after Qwen3's thought when thinking is on), so the answer is always a call.
- Parsing: whole answers with ``split_tool_calls``; streams with ``ToolCallStream``, which passes content through,
  holds back what could still open a block, and sends each call as it is written, as OpenAI and vLLM stream them:
  a delta with its ``index``, ``id``, ``type`` and ``name`` (``arguments`` "") once ``{"name": "...", "arguments": ``
  is written, then the arguments piece by piece (what could still be the block's closing ``}`` or tag held back),
  adding up to the same JSON string a whole answer has (arguments written as an object are kept as written). A
  block that does not start that way is sent whole when it closes, and stays text if it is not valid JSON, in both;
  a block whose arguments were already streamed and then turn out broken (cut by ``max_tokens``) keeps the deltas
  sent (vLLM's streaming parser does the same). A choice that made a call finishes with
  ``tool_calls``. Calls inside a thought are part of the thought (``reasoning_content``), as vLLM's.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A malformed ``tools`` / ``tool_choice``: a 400 naming ``param`` (``app.openai_format`` answers it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_tools(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """{name: parameters schema} of OpenAI function tools; a malformed one is a 400 naming ``tools``."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(
                f'tools[{i}]: must be {{"type": "function", "function": {{"name", "parameters"}}}}', "tools"
            )
        name, params = fn.get("name"), fn.get("parameters", {"type": "object"})
        if not isinstance(name, str) or not name:
            raise ToolError(f"tools[{i}].function.name: must be a non-empty string", "tools")
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters: must be a JSON schema object", "tools")
        out[name] = params
    return out


def chosen(tool_choice: Any, tools: dict[str, dict[str, Any]]) -> str | None:
    """``none`` / ``auto`` / ``required``, or the named function's name; a bad choice is a 400 naming ``tool_choice``."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError(f"tool_choice: must be one of {', '.join(CHOICES)} or a named function", "tool_choice")
        if tool_choice == "required" and not tools:
            raise ToolError("tool_choice: 'required' needs tools", "tool_choice")
        return tool_choice if tools else "none"
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in tools:
        raise ToolError(f"tool_choice: names no function of tools ({name!r})", "tool_choice")
    return str(name)


def call_grammar(tools: dict[str, dict[str, Any]], choice: str) -> str:
    """The llguidance Lark grammar of ``required`` (one or more calls of any tool) or of one call of ``choice``."""
    names = list(tools) if choice == "required" else [choice]
    schemas = [_call_schema(n, tools[n]) for n in names]
    schema = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    call = f"%json {json.dumps({**schema, 'x-guidance': layout})}"
    repeat = ' ("\\n" call)*' if choice == "required" else ""
    # the tags unquoted: Qwen3's single added tokens, which llguidance reads as special tokens, not their text
    return f'start: call{repeat}\ncall: {TOOL_OPEN} "\\n" {call} "\\n" {TOOL_CLOSE}\n'


def _call_schema(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _call(raw: str, index: int) -> dict[str, Any] | None:
    """The OpenAI tool call of a block's text, or None when it is not ``{"name", "arguments"}`` JSON. Arguments
    written as an object are kept as the model wrote them (what a stream sends piece by piece adds up to it)."""
    try:
        call = json.loads(raw.strip())
        name, args = call["name"], call.get("arguments", {})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    written = _written_arguments(raw)
    if isinstance(args, str):
        arguments = args
    elif written is not None and written[0] == name:
        arguments = written[1]
    else:
        arguments = json.dumps(args, ensure_ascii=False)
    fn = {"name": str(name), "arguments": arguments}
    return {"index": index, "id": f"call-{secrets.token_hex(12)}", "type": "function", "function": fn}


# a block's start up to its arguments' value, when the model writes name first (Qwen3's hermes format)
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=[{\[])')
# what may still end a block whose arguments are being streamed: the outer "}" and a part of the closing tag
_TAIL = re.compile(r"\s*\}?\s*$")


def _header(block: str) -> tuple[str, int] | None:
    """(the function's name, where its arguments' value starts) once a block's text has got that far."""
    m = _HEADER.match(block)
    if m is None:
        return None
    try:
        return str(json.loads(m.group(1))), m.end()
    except ValueError:
        return None


def _written_arguments(block: str) -> tuple[str, str] | None:
    """(name, the arguments object's JSON text as written) of a ``{"name", "arguments"}`` block; None otherwise."""
    head = _header(block)
    if head is None:
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(block, head[1])
    except ValueError:
        return None
    return (head[0], block[head[1] : end]) if block[end:].strip() == "}" else None


def split_tool_calls(content: str) -> tuple[str, list[dict[str, Any]]]:
    """(content without the tool-call blocks, OpenAI ``tool_calls``); a block that is not valid JSON stays text."""
    calls: list[dict[str, Any]] = []
    kept, rest = [], content
    while (start := rest.find(TOOL_OPEN)) != -1 and (end := rest.find(TOOL_CLOSE, start)) != -1:
        call = _call(rest[start + len(TOOL_OPEN) : end], len(calls))
        kept.append(rest[: end + len(TOOL_CLOSE)] if call is None else rest[:start])
        if call is not None:
            del call["index"]
            calls.append(call)
        rest = rest[end + len(TOOL_CLOSE) :]
    return ("".join(kept) + rest).strip() if calls else content, calls


class ToolCallStream:
    """One choice's content stream split into (content delta, tool-call deltas) (see the module docstring)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.calls = 0
        self._blank = ""  # blank content held back (see ``_unblank``)
        self._sent = False  # whether any non-blank content went out
        self._streaming: tuple[int, int] | None = None  # the open call's (arguments' start, characters sent)

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        content, deltas = "", []
        while True:
            if not self.in_call:
                at = self.buffer.find(TOOL_OPEN)
                if at == -1:
                    keep = 0 if final else _partial_suffix(self.buffer, TOOL_OPEN)
                    content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content, self.buffer, self.in_call = (
                    content + self.buffer[:at],
                    self.buffer[at + len(TOOL_OPEN) :],
                    True,
                )
            at = self.buffer.find(TOOL_CLOSE)
            if at == -1:
                if self._streaming is not None:
                    deltas += self._arguments()
                elif not final:
                    deltas += self._open()
                if final:  # an unclosed block stays text, unless its call was already being sent
                    content += TOOL_OPEN + self.buffer if self._streaming is None else ""
                    self._streaming, self.buffer = None, ""
                break
            deltas += self._close(at) if self._streaming is not None else []
            if self._streaming is None:
                call = _call(self.buffer[:at], self.calls)
                if call is None:
                    content += TOOL_OPEN + self.buffer[: at + len(TOOL_CLOSE)]
                else:
                    self.calls += 1
                    arguments = call["function"]["arguments"]
                    deltas += [{**call, "function": {**call["function"], "arguments": ""}}]
                    deltas += [{"index": call["index"], "function": {"arguments": arguments}}]
            self._streaming = None
            self.buffer, self.in_call = self.buffer[at + len(TOOL_CLOSE) :], False
        return self._unblank(content, final), deltas

    def _open(self) -> list[dict[str, Any]]:
        """The open block's first delta (index, id, name) once its name is written, then what its arguments have."""
        head = _header(self.buffer)
        if head is None:
            return []
        fn = {"name": head[0], "arguments": ""}
        call = {"index": self.calls, "id": f"call-{secrets.token_hex(12)}", "type": "function", "function": fn}
        self.calls += 1
        self._streaming = (head[1], 0)
        return [call, *self._arguments()]

    def _arguments(self) -> list[dict[str, Any]]:
        """The open call's arguments written since the last delta, less what may still be the block's end."""
        assert self._streaming is not None
        start, sent = self._streaming
        written = self.buffer[start:]
        written = written[: len(written) - _partial_suffix(written, TOOL_CLOSE)]
        tail = _TAIL.search(written)
        return self._send(written[: tail.start()] if tail else written, start, sent)

    def _close(self, at: int) -> list[dict[str, Any]]:
        """The streamed call's last arguments delta: its arguments as the whole answer gives them."""
        assert self._streaming is not None
        start, sent = self._streaming
        call = _call(self.buffer[:at], self.calls - 1)
        written = call["function"]["arguments"] if call is not None else self.buffer[start:at].rstrip()
        return self._send(written if written.startswith(self.buffer[start : start + sent]) else "", start, sent)

    def _send(self, written: str, start: int, sent: int) -> list[dict[str, Any]]:
        if len(written) <= sent:
            return []
        self._streaming = (start, len(written))
        return [{"index": self.calls - 1, "function": {"arguments": written[sent:]}}]

    def _unblank(self, content: str, final: bool) -> str:
        """Blank text waits until something else follows it; around calls it is dropped (``split_tool_calls``
        strips the content of an answer with calls, so the streamed content adds up to the same text)."""
        text, self._blank = self._blank + content, ""
        stripped = text.rstrip()
        out = stripped.lstrip() if self.calls and not self._sent else stripped
        self._sent = self._sent or bool(stripped)
        tail = text[len(stripped) :]
        if final:
            return out if self.calls else out + tail
        self._blank = tail
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back until the next delta decides)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)
