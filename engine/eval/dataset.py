"""The test set: JSONL conversations -> prompts (rendered like training data) and reference answers.

A test line is a conversation whose last turn is the reference assistant answer (the seed's
``customed_test_1k.jsonl``: OpenAI ``messages`` with system, user, assistant). The prompt is everything before that
turn, rendered by ``engine.data.templates.encode_prompt`` — the same code preprocessing uses, so the model sees at
eval exactly the prompt layout it was trained on (``enable_thinking`` included).

Lines that cannot be scored (malformed JSON, no assistant answer, a conversation the template refuses, a prompt
longer than ``seq_length``) are bad lines: under policy ``skip`` they are reported and left out of the accuracy;
under ``error`` the first one fails the job naming its file and line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from engine.contract.runfiles import BadInput
from engine.data.formats import Converter, FormatError
from engine.data.readers import RecordError, input_files, iter_raw, parse_record
from engine.data.templates import ConversationError, encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BadLinePolicy = Literal["skip", "error"]


@dataclasses.dataclass
class TestLine:
    """One scorable test line."""

    number: int  # 1-based line (or row) of the file
    input: str  # the last user turn: what the model is asked
    reference: str  # the reference assistant answer, raw
    prompt_ids: list[int]


@dataclasses.dataclass
class BadLine:
    number: int
    reason: str


@dataclasses.dataclass
class TestSet:
    path: str
    lines: list[TestLine]
    bad: list[BadLine]


def _split_reference(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    reference = messages[-1]["content"]
    if not isinstance(reference, str) or not reference.strip():
        raise RecordError("no assistant answer: the last assistant turn is empty")
    return messages[:-1], reference


def _last_user(messages: Sequence[dict[str, Any]]) -> str:
    return next((m["content"] for m in reversed(messages) if m["role"] in ("user", "observation")), "")


def _parse_line(
    payload: str | dict[str, Any],
    converter: Converter,
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    enable_thinking: str,
    max_prompt_tokens: int | None,
) -> tuple[str, str, list[int]]:
    try:
        messages = converter.messages(parse_record(payload))
    except FormatError as err:
        if "must end with an assistant turn" in str(err):
            raise RecordError("no assistant answer: the last turn is not an assistant turn") from err
        raise RecordError(str(err)) from err
    prompt_messages, reference = _split_reference(messages)
    try:
        prompt_ids = encode_prompt(tokenizer, prompt_messages, template, enable_thinking)
    except ConversationError as err:
        raise RecordError(str(err)) from err
    if max_prompt_tokens is not None and len(prompt_ids) > max_prompt_tokens:
        raise RecordError(f"prompt has {len(prompt_ids)} tokens, more than the {max_prompt_tokens} allowed")
    return _last_user(prompt_messages), reference, prompt_ids


def read_test_set(
    path: str | os.PathLike[str],
    tokenizer: PreTrainedTokenizerBase,
    *,
    template: str = "qwen3",
    enable_thinking: str = "none",
    map_keys: dict[str, Any] | None = None,
    limit: int | None = None,
    max_prompt_tokens: int | None = None,
    policy: BadLinePolicy = "skip",
) -> TestSet:
    """Read up to ``limit`` lines (bad ones count towards it, as the seed's ``--eval-data-size`` counts lines)."""
    try:
        files = input_files(path)
    except BadInput as err:
        raise BadInput(str(err).replace("input:", "eval_data_path:", 1), field="eval_data_path") from err
    try:
        converter = Converter("SharegptStyleInstructionHandler", map_keys)
    except ValueError as err:
        raise BadInput(str(err), field="map_keys") from err
    lines: list[TestLine] = []
    bad: list[BadLine] = []
    for file, number, payload in iter_raw(files):
        if limit is not None and len(lines) + len(bad) >= limit:
            break
        try:
            lines.append(
                TestLine(
                    number, *_parse_line(payload, converter, tokenizer, template, enable_thinking, max_prompt_tokens)
                )
            )
        except RecordError as err:
            if policy == "error":
                raise BadInput(
                    f"eval_data_path: {file}:{number}: {err} (bad_line_policy is error)", field="eval_data_path"
                ) from err
            bad.append(BadLine(number, str(err)))
    return TestSet(str(path), lines, bad)
