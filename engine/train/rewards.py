"""Stage grpo's built-in rule rewards: no user code runs on a worker, only these, configured by the spec
(``engine.contract.spec.RewardFunc``).

Each scores one completion (its text, its token count, whether it was cut at ``max_completion_length``) against
the prompt's reference answer (the dataset's assistant turn) and returns a float. ``strip_thinking`` scores the
answer after Qwen3's ``<think>...</think>`` block (a completion still inside its thinking block has an empty
answer). A regex match is time-bounded (the ``regex`` package's ``timeout``): a pattern that backtracks for too
long scores 0 and is counted as a failure, never stalling the step. ``http`` rewards (the team's own service,
``engine.train.http_rewards``) score whole batches; a batch that fails scores NaN (TRL's None), which the weighted
sum skips (``nansum``), and is counted as failures.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

import jsonschema  # type: ignore[import-untyped]
import regex  # type: ignore[import-untyped]

from engine.contract.spec import RewardFunc
from engine.train.http_rewards import HttpReward

REGEX_TIMEOUT_S = 0.5
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_FORMAT = regex.compile(r"\s*<think>.*?</think>\s*\S", regex.DOTALL)


def strip_thinking(text: str) -> str:
    """The answer after the thinking block ("" while the completion is still thinking), whitespace-trimmed."""
    if THINK_CLOSE in text:
        return text.split(THINK_CLOSE, 1)[1].strip()
    if text.lstrip().startswith(THINK_OPEN):
        return ""
    return text.strip()


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str
    tokens: int
    truncated: bool
    reference: str
    prompt: str = ""  # the prompt as the model saw it (its chat template), for http rewards


@dataclasses.dataclass
class Scores:
    """(completions × functions) rewards, and per function the completions whose scoring failed (a rule reward's
    scored 0, an http reward's NaN)."""

    values: list[list[float]]
    failures: dict[str, int]


class RuleReward:
    """One configured reward function."""

    def __init__(self, func: RewardFunc, max_completion_length: int) -> None:
        self.func, self.key, self.max_len = func, func.key, max_completion_length
        self.pattern = regex.compile(func.pattern) if func.pattern is not None else None
        self.validator = None
        if func.json_schema is not None:
            cls = jsonschema.validators.validator_for(func.json_schema)
            self.validator = cls(func.json_schema)

    def _answer(self, c: Completion) -> str:
        return strip_thinking(c.text) if self.func.strip_thinking else c.text.strip()

    def __call__(self, c: Completion) -> float:
        name = self.func.name
        if name == "exact_match":
            return float(self._answer(c) == strip_thinking(c.reference))
        if name == "contains":
            ref = strip_thinking(c.reference)
            return float(bool(ref) and ref in self._answer(c))
        if name == "regex":
            assert self.pattern is not None
            return float(self.pattern.search(self._answer(c), timeout=REGEX_TIMEOUT_S) is not None)
        if name == "json_schema":
            assert self.validator is not None
            try:
                value = json.loads(self._answer(c))
            except ValueError:
                return 0.0
            return float(self.validator.is_valid(value))
        if name == "length":  # DAPO's soft overlong punishment
            assert self.func.overlong_buffer is not None
            safe = self.max_len - self.func.overlong_buffer
            if c.tokens <= safe:
                return 0.0
            return max(-1.0, (safe - c.tokens) / self.func.overlong_buffer)
        if name == "format":
            return float(_FORMAT.match(c.text) is not None)
        raise ValueError(f"reward_funcs: unknown reward {name!r}")


Reward = RuleReward | HttpReward


def build_rewards(funcs: Sequence[RewardFunc], max_completion_length: int) -> list[Reward]:
    return [HttpReward(f) if f.name == "http" else RuleReward(f, max_completion_length) for f in funcs]


def _rule_column(reward: RuleReward, completions: Sequence[Completion]) -> tuple[list[float], int]:
    column, failures = [], 0
    for c in completions:
        try:
            column.append(reward(c))
        except TimeoutError:
            failures += 1
            column.append(0.0)
    return column, failures


def score(rewards: Sequence[Reward], completions: Sequence[Completion]) -> Scores:
    """Every completion by every function; a rule that fails on a completion (a regex timeout) scores 0 there, an
    http batch that fails scores NaN; both are counted."""
    failures, columns = {}, []
    for r in rewards:
        if isinstance(r, HttpReward):
            items = [{"prompt": c.prompt, "completion": c.text, "reference": c.reference} for c in completions]
            column, failures[r.key] = r.score(items)
        else:
            column, failures[r.key] = _rule_column(r, completions)
        columns.append(column)
    return Scores([list(row) for row in zip(*columns, strict=True)], failures)


def json_rewards(keys: Sequence[str], row: Sequence[float]) -> dict[str, float | None]:
    """One completion's per-function rewards for completions.jsonl: null where unscored (NaN is not JSON)."""
    return {k: (None if math.isnan(v) else v) for k, v in zip(keys, row, strict=True)}
