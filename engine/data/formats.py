"""Instruction formats: a decoded record -> a normalized conversation (list of ``{"role", "content"}``).

Public interface (shared with evaluation):

- ``iter_conversations(path, map_keys=None, handler_name="SharegptStyleInstructionHandler")`` yields
  ``(file, number, messages)`` for every record of a file or directory (see ``readers`` for what ``number`` counts) and
  raises ``BadInput`` naming the file, line and problem at the first bad record.
- ``Converter(handler_name, map_keys)`` with ``.messages(record)`` for one record (raises ``FormatError``).

Formats, chosen by MindSpeed's ``--handler-name`` (``HANDLERS``), with MindSpeed's ``--map-keys`` defaults:

- ShareGPT (``SharegptStyleInstructionHandler``): ``{"messages": "conversations", "system": <column or absent>,
  "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
  "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}}``. A first message with
  the system tag is the system prompt; otherwise the ``system`` column, when mapped. Tags missing from a given
  ``map_keys`` keep these defaults. OpenAI messages are ShareGPT with ``{"messages": "messages", "tags": {"role_tag":
  "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant", "system_tag": "system"}}`` (the
  seed's ``--map-keys``); without ``map_keys``, a record that has ``messages`` and no ``conversations`` is read so.
  ``{"tools": "<column>"}`` reads that column's tool definitions (a JSON string or list, as in LLaMA-Factory's
  glaive_toolcall data) into a ``tools`` message after the system prompt; like MindSpeed, tools are read only when
  mapped. An OpenAI assistant message with ``tool_calls`` becomes a function turn (its calls as a JSON list).
- Alpaca (``AlpacaStyleInstructionHandler``, ``GeneralInstructionHandler``): ``{"prompt": "instruction",
  "query": "input", "response": "output"}``; the user turn is ``instruction + "\\n" + input`` (empty parts omitted).
  ``system`` and ``history`` (a list of ``[query, response]`` pairs before this turn) are read only when mapped,
  e.g. ``{"system": "system", "history": "history"}``, as in MindSpeed.
- Pairwise (``SharegptStylePairwiseHandler`` / ``AlpacaStylePairwiseHandler``, MindSpeed's ``ranking`` datasets):
  ``Converter.pair(record)`` gives (prompt ending with a user turn, chosen, rejected); ShareGPT reads ``chosen`` /
  ``rejected`` message objects (``{"from": "gpt", "value": ...}``), Alpaca strings (from list columns MindSpeed takes
  ``chosen[0]`` and ``rejected[1]``); the column names are map_keys ``chosen`` / ``rejected``. Without ``map_keys`` the
  ShareGPT pairwise handler also reads OpenAI's preference fine-tuning JSONL: ``{"input": {"messages": [...]},
  "preferred_output": [assistant message], "non_preferred_output": [assistant message]}``. A pairwise record under
  an instruction handler is refused with a message naming the pairwise handler.
- Plain text (``GeneralPretrainHandler`` or no handler): not a conversation; see ``text_fields``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from engine.contract.data_formats import (
    OPENAI_PREFERENCE_KEYS,
    OPENAI_TAGS,
    PAIRWISE_HANDLERS,
    SHAREGPT_TAGS,
    check_map_keys,
    handler_format,
)
from engine.contract.runfiles import BadInput
from engine.data.readers import RecordError, input_files, iter_raw, parse_record, unit
from engine.data.templates import ConversationError, check_conversation

_ROLE_OF_TAG = {
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "observation",
    "function_tag": "function",
    "system_tag": "system",
}


class FormatError(ValueError):
    """A record that does not fit its format (missing key, unknown role, bad turn order); caller adds file/line."""


class Converter:
    """Turns decoded records of one format into checked conversations (see the module docstring)."""

    def __init__(self, handler_name: str | None, map_keys: dict[str, Any] | None = None):
        self.format = handler_format(handler_name)
        if self.format == "text":
            raise ValueError(f"handler_name: {handler_name or '(none)'} reads plain text, not conversations")
        self.pairwise = handler_name in PAIRWISE_HANDLERS
        self.explicit = map_keys is not None
        keys = dict(map_keys or {})
        check_map_keys(self.format, keys, self.pairwise)
        self.keys = keys
        self.tags = {**SHAREGPT_TAGS, **keys.get("tags", {})}

    def messages(self, record: dict[str, Any]) -> list[dict[str, str]]:
        """The record's conversation, validated for the templates. Raises ``FormatError``."""
        if self.pairwise:
            raise FormatError("a pairwise handler reads chosen/rejected pairs (Converter.pair), not conversations")
        if isinstance(record, dict) and "chosen" in record and "rejected" in record:
            pairwise = "SharegptStylePairwiseHandler" if self.format == "sharegpt" else "AlpacaStylePairwiseHandler"
            raise FormatError(
                f"a pairwise (preference) record with chosen/rejected answers; preprocess it with "
                f"handler_name {pairwise}"
            )
        try:
            raw = self._sharegpt(record) if self.format == "sharegpt" else self._alpaca(record)
            return check_conversation(raw)
        except ConversationError as err:
            raise FormatError(str(err)) from err

    def pair(self, record: dict[str, Any]) -> tuple[list[dict[str, str]], dict[str, str], dict[str, str]]:
        """A pairwise record as (prompt conversation ending with a user turn, chosen answer, rejected answer), as
        MindSpeed's ``convert_{sharegpt,alpaca}_to_intermediate`` read it with ``ranking``. Raises ``FormatError``."""
        chosen_key, rejected_key = self.keys.get("chosen", "chosen"), self.keys.get("rejected", "rejected")
        try:
            if self.format == "sharegpt" and not self.explicit and OPENAI_PREFERENCE_KEYS <= record.keys():
                prompt, answers = self._openai_pair(record)
            elif self.format == "sharegpt":
                prompt = self._sharegpt(record)
                answers = [self._sharegpt_answer(_require(record, k), k) for k in (chosen_key, rejected_key)]
            else:
                prompt = self._alpaca_prompt(record)
                chosen, rejected = _require(record, chosen_key), _require(record, rejected_key)
                if isinstance(chosen, list):  # MindSpeed takes chosen[0] and rejected[1] from list columns
                    chosen, rejected = chosen[0], rejected[1]
                answers = [{"role": "assistant", "content": a} for a in (chosen, rejected)]
            checked = check_conversation(prompt, need_response=False)
            if checked[-1]["role"] not in ("user", "observation"):
                raise FormatError("a pairwise prompt must end with a user turn (chosen/rejected answer it)")
            for answer in answers:
                check_conversation([*checked, answer])
        except ConversationError as err:
            raise FormatError(str(err)) from err
        return checked, answers[0], answers[1]

    def _openai_pair(self, record: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
        """OpenAI's preference record: the prompt from ``input.messages``, each answer a one-message list."""
        prompt_record = record["input"]
        if not isinstance(prompt_record, dict):
            raise FormatError(f"'input' must be an object with 'messages', got {type(prompt_record).__name__}")
        answers = []
        for key in ("preferred_output", "non_preferred_output"):
            value = record[key]
            if not isinstance(value, list) or len(value) != 1:
                raise FormatError(f"{key!r} must be a list of one assistant message")
            if not isinstance(value[0], dict) or value[0].get("role") != "assistant":
                raise FormatError(f"{key!r}: the message's role must be 'assistant'")
            answers.append({"role": "assistant", "content": _require(value[0], "content", f"{key}: ")})
        return self._sharegpt(prompt_record), answers

    def _sharegpt_answer(self, value: object, key: str) -> dict[str, str]:
        tags = self.tags
        if not isinstance(value, dict):
            raise FormatError(f"{key!r} must be a message object, got {type(value).__name__}")
        role = {tags["assistant_tag"]: "assistant", tags["function_tag"]: "function"}.get(value.get(tags["role_tag"]))
        if role is None:
            raise FormatError(f"{key!r}: role must be {tags['assistant_tag']!r} or {tags['function_tag']!r}")
        return {"role": role, "content": _require(value, tags["content_tag"], f"{key}: ")}

    # ------------------------------------------------------------ ShareGPT / OpenAI

    def _sharegpt(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        column, tags = self.keys.get("messages", "conversations"), self.tags
        if not self.explicit and column not in record and "messages" in record:
            column, tags = "messages", OPENAI_TAGS
        turns = _require(record, column)
        if not isinstance(turns, list):
            raise FormatError(f"{column!r} must be a list of messages, got {type(turns).__name__}")
        if not turns:
            raise FormatError("empty conversation")
        role_of = {tags[t]: role for t, role in _ROLE_OF_TAG.items() if tags.get(t) is not None}
        out: list[dict[str, Any]] = []
        system_column = self.keys.get("system")
        if system_column and record.get(system_column) and not _is_system(turns[0], tags):
            out.append({"role": "system", "content": record[system_column]})
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise FormatError(f"turn {i}: expected an object, got {type(turn).__name__}")
            tag = _require(turn, tags["role_tag"], f"turn {i}: ")
            if tag not in role_of:
                raise FormatError(f"turn {i}: unknown role {tag!r} (known: {', '.join(map(repr, role_of))})")
            if turn.get("tool_calls"):  # OpenAI messages: an assistant turn that calls tools is a function turn
                out.append(_function_turn(turn, i))
                continue
            out.append({"role": role_of[tag], "content": _require(turn, tags["content_tag"], f"turn {i}: ")})
        tools_column = self.keys.get("tools")
        if tools_column and record.get(tools_column):  # MindSpeed reads tools only when mapped (parser.py: None)
            out.insert(1 if out[0]["role"] == "system" else 0, {"role": "tools", "content": record[tools_column]})
        return out

    # ------------------------------------------------------------ Alpaca

    def _alpaca(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        response = _require(record, self.keys.get("response", "output"))
        return [*self._alpaca_prompt(record), {"role": "assistant", "content": response}]

    def _alpaca_prompt(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        prompt = _require(record, self.keys.get("prompt", "instruction"))
        query_key = self.keys.get("query", "input")
        parts = [p for p in (prompt, record.get(query_key) if query_key else None) if p]
        out: list[dict[str, Any]] = []
        if self.keys.get("system") and record.get(self.keys["system"]):
            out.append({"role": "system", "content": record[self.keys["system"]]})
        for j, pair in enumerate((record.get(self.keys["history"]) or []) if self.keys.get("history") else []):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise FormatError(f"history item {j}: expected [query, response]")
            out += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        out.append({"role": "user", "content": "\n".join(str(p) for p in parts)})
        return out


def _function_turn(turn: dict[str, Any], i: int) -> dict[str, str]:
    """An OpenAI assistant message with ``tool_calls`` as a function turn (JSON list of name/arguments)."""
    if turn.get("content"):
        raise FormatError(f"turn {i}: an assistant turn with both text and tool_calls is not supported")
    calls = []
    for call in turn["tool_calls"] if isinstance(turn["tool_calls"], list) else [None]:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or "name" not in fn or "arguments" not in fn:
            raise FormatError(f"turn {i}: each tool_calls entry needs a function name and arguments")
        calls.append({"name": fn["name"], "arguments": fn["arguments"]})
    return {"role": "function", "content": json.dumps(calls, ensure_ascii=False)}


def _is_system(turn: object, tags: dict[str, str]) -> bool:
    return isinstance(turn, dict) and turn.get(tags["role_tag"]) == tags.get("system_tag")


def _require(obj: dict[str, Any], key: str, where: str = "") -> Any:  # Any: a JSON record's value
    if key not in obj or obj[key] is None:
        raise FormatError(f"{where}missing key {key!r}")
    return obj[key]


def text_fields(record: dict[str, Any], json_keys: list[str]) -> list[str]:
    """The pretraining texts of a record, one per ``json_keys`` entry. Raises ``FormatError``."""
    texts = []
    for key in json_keys:
        value = _require(record, key)
        if not isinstance(value, str):
            raise FormatError(f"{key!r} must be a string, got {type(value).__name__}")
        texts.append(value)
    return texts


def where(file: str, number: int) -> str:
    """``file, line N`` / ``file, row N`` for error messages."""
    return f"{file}, {unit(file)} {number}"


def iter_conversations(
    path: str | os.PathLike[str],
    map_keys: dict[str, Any] | None = None,
    handler_name: str = "SharegptStyleInstructionHandler",
) -> Iterator[tuple[str, int, list[dict[str, str]]]]:
    """``(file, number, messages)`` for every record under ``path``; ``BadInput`` names the first bad record."""
    try:
        converter = Converter(handler_name, map_keys)
    except ValueError as err:  # messages start with the field: "handler_name: ..." or "map_keys: ..."
        raise BadInput(str(err), field=str(err).split(":")[0]) from err
    for file, number, payload in iter_raw(input_files(path)):
        try:
            yield file, number, converter.messages(parse_record(payload))
        except (RecordError, FormatError) as err:
            raise BadInput(f"{where(file, number)}: {err}", field="input") from err
