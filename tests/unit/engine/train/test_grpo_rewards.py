"""Stage grpo's rule rewards on hand-made completions: each function's rule, the thinking block stripped, and a
catastrophically backtracking regex bounded in time (scored 0, counted as a failure)."""

from __future__ import annotations

import time

from engine.contract.spec import RewardFunc
from engine.train.rewards import Completion, build_rewards, score, strip_thinking


def _c(text: str, reference: str = "greeting", tokens: int = 5) -> Completion:
    return Completion(text, tokens, False, reference)


def _one(func: dict, *completions: Completion) -> list[float]:
    (reward,) = build_rewards([RewardFunc(**func)], 100)
    return [reward(c) for c in completions]


def test_strip_thinking() -> None:
    assert strip_thinking("<think>\nhm\n</think>\n\n greeting ") == "greeting"
    assert strip_thinking("<think> still going") == ""
    assert strip_thinking(" greeting\n") == "greeting"


def test_exact_match_and_contains() -> None:
    done = _c("<think>x</think>\ngreeting", reference="<think>\n\n</think>\n\ngreeting")
    assert _one({"name": "exact_match"}, done, _c("greeting!"), _c("<think>greeting")) == [1.0, 0.0, 0.0]
    assert _one({"name": "exact_match", "strip_thinking": False}, done) == [0.0]
    assert _one({"name": "contains"}, _c("it is a greeting."), _c("farewell"), _c("x", reference="")) == [1, 0, 0]


def test_regex_json_format_and_length() -> None:
    assert _one({"name": "regex", "pattern": r"^\d+$"}, _c("<think>a</think>42"), _c("4 2")) == [1.0, 0.0]
    schema = {"type": "object", "required": ["intent"], "properties": {"intent": {"type": "string"}}}
    got = _one({"name": "json_schema", "json_schema": schema}, _c('{"intent": "x"}'), _c('{"i": 1}'), _c("{"))
    assert got == [1.0, 0.0, 0.0]
    assert _one({"name": "format"}, _c("<think>hm</think> yes"), _c("<think>hm</think>  "), _c("yes")) == [1, 0, 0]
    length = {"name": "length", "overlong_buffer": 20}  # max 100: free up to 80, -1 at 100
    assert _one(length, _c("", tokens=80), _c("", tokens=90), _c("", tokens=100)) == [0.0, -0.5, -1.0]


def test_a_backtracking_regex_is_time_bounded() -> None:
    rewards = build_rewards([RewardFunc(name="regex", pattern=r"(a|aa)+c", strip_thinking=False)], 100)
    started = time.monotonic()
    scores = score(rewards, [_c("a" * 60), _c("aac")])
    # unbounded, (a|aa)+c on 60 a's backtracks ~fib(60) times (hours); the bound is the timeout plus slack for a loaded
    # machine (9.2 s was seen at load 20 under a 5 s bound)
    assert time.monotonic() - started < 30
    assert scores.values == [[0.0], [1.0]] and scores.failures == {"regex": 1}
