"""Qwen3 tool calls on the OpenAI routes (vLLM's ``hermes`` parser, which its ``qwen3_json`` aliases).

- ``tools``: OpenAI function tools, checked here (a bad one is a 400 naming ``tools``) and rendered by the engine's
  chat template (Qwen3's ``<tools>`` system block).
- ``tool_choice``: ``auto`` (the default with tools): the answer's ``<tool_call>{"name", "arguments"}</tool_call>``
  blocks become ``tool_calls``; ``none``: the tools are not rendered and nothing is parsed (the model cannot call one);
  ``required`` or ``{"type": "function", "function": {"name"}}``: the engine decodes within a grammar of one or more
  such blocks (one, for a named function) whose ``arguments`` follow the function's ``parameters`` schema
  (``engine.serve.structured``, after Qwen3's thought when thinking is on), so the answer is always a call.
- Parsing: whole answers with ``split_tool_calls``; streams with ``ToolCallStream``, which passes content through,
  holds back what could still open a block, and sends each call once its block closes: a delta with its ``index``,
  ``id``, ``type`` and ``name`` (``arguments`` ""), then one with its ``arguments``, the same JSON string a whole
  answer has. A block that is not valid JSON stays text, in both. A choice that made a call finishes with
  ``tool_calls``. Calls inside a thought are part of the thought (``reasoning_content``), as vLLM's.
"""

from __future__ import annotations

import json
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
    """The OpenAI tool call of a block's text, or None when it is not ``{"name", "arguments"}`` JSON."""
    try:
        call = json.loads(raw.strip())
        name, args = call["name"], call.get("arguments", {})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    fn = {"name": str(name), "arguments": arguments}
    return {"index": index, "id": f"call-{secrets.token_hex(12)}", "type": "function", "function": fn}


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
                if final:  # an unclosed block stays text
                    content, self.buffer = content + TOOL_OPEN + self.buffer, ""
                break
            call = _call(self.buffer[:at], self.calls)
            if call is None:
                content += TOOL_OPEN + self.buffer[: at + len(TOOL_CLOSE)]
            else:
                self.calls += 1
                arguments = call["function"]["arguments"]
                deltas += [{**call, "function": {**call["function"], "arguments": ""}}]
                deltas += [{"index": call["index"], "function": {"arguments": arguments}}]
            self.buffer, self.in_call = self.buffer[at + len(TOOL_CLOSE) :], False
        return self._unblank(content, final), deltas

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
