"""Scoring generated answers against reference assistant turns: the seed's exact-match accuracy and its breakdowns.

A ``<think>…</think>`` block is part of the raw prediction but never of the answer: Qwen3 models fine-tuned with
``--enable-thinking true`` emit an (often empty) thought before the label, and the reference may carry one too.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable
from typing import Any, Literal

NormRule = Literal["trim", "case"]
NORM_RULES: tuple[str, ...] = ("trim", "case")

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_OPEN_THINK = re.compile(r"<think>.*\Z", re.DOTALL)  # a thought cut off by max_new_tokens: no answer yet


def strip_thinking(text: str) -> str:
    """Remove every ``<think>…</think>`` block, and an unclosed trailing ``<think>…``, plus surrounding whitespace."""
    text = _THINK_BLOCK.sub("", text)
    text = _OPEN_THINK.sub("", text)
    return text.strip()


def normalize(text: str, rules: Iterable[str]) -> str:
    """Apply the optional normalisation rules: ``trim`` (outer whitespace), ``case`` (case-insensitive)."""
    for rule in rules:
        if rule == "trim":
            text = text.strip()
        elif rule == "case":
            text = text.casefold()
        else:
            raise ValueError(f"unknown normalisation rule {rule!r}; known: {', '.join(NORM_RULES)}")
    return text


def parse_answer(output: str, rules: Iterable[str] = ()) -> str:
    """The answer that is scored: the raw output without its thought, normalised."""
    return normalize(strip_thinking(output), rules)


@dataclasses.dataclass
class _LabelCount:
    total: int = 0
    correct: int = 0


class Scoreboard:
    """Accumulates exact-match results; ``summary()`` gives accuracy, per-label accuracy and the top confusions."""

    def __init__(self, rules: Iterable[str] = ("trim",), max_labels: int = 200, top_confusions: int = 10):
        self.rules = tuple(rules)
        for rule in self.rules:
            normalize("", [rule])  # fail early on an unknown rule
        self.max_labels = max_labels
        self.top_confusions = top_confusions
        self.labels: dict[str, _LabelCount] = collections.defaultdict(_LabelCount)
        self.confusions: collections.Counter[tuple[str, str]] = collections.Counter()

    def add(self, output: str, reference: str) -> tuple[str, bool]:
        """Score one prediction; returns (parsed answer, correct). The label is the parsed reference."""
        answer = parse_answer(output, self.rules)
        label = parse_answer(reference, self.rules)
        correct = answer == label
        count = self.labels[label]
        count.total += 1
        count.correct += correct
        if not correct:
            self.confusions[(label, answer)] += 1
        return answer, correct

    @property
    def total(self) -> int:
        return sum(c.total for c in self.labels.values())

    @property
    def correct(self) -> int:
        return sum(c.correct for c in self.labels.values())

    def summary(self) -> dict[str, Any]:
        total, correct = self.total, self.correct
        # Most frequent labels first; free-form references would otherwise make the summary as long as the test set.
        ranked = sorted(self.labels.items(), key=lambda kv: (-kv[1].total, kv[0]))
        per_label = {
            label: {"total": c.total, "correct": c.correct, "accuracy": c.correct / c.total}
            for label, c in ranked[: self.max_labels]
        }
        return {
            "accuracy": correct / total if total else 0.0,
            "total": total,
            "correct": correct,
            "num_labels": len(self.labels),
            "per_label": per_label,
            "confusion": [
                {"reference": ref, "answer": ans, "count": n}
                for (ref, ans), n in self.confusions.most_common(self.top_confusions)
            ],
        }
