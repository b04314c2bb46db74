"""Exact-match scoring with known answers: thinking stripped, normalisation rules, per-label accuracy, confusions."""

from __future__ import annotations

import pytest

from engine.eval.scoring import Scoreboard, parse_answer, strip_thinking


@pytest.mark.parametrize(
    "raw,answer",
    [
        ("<think>\n\n</think>\n\n闲聊百科_知识查询", "闲聊百科_知识查询"),
        ("<think>\nthe user asks about weather\n</think>\n\n天气_查询 ", "天气_查询"),
        ("  音乐_播放\n", "音乐_播放"),
        ("<think>\nstill thinking when max_new_tokens ran out", ""),
        ("a<think>x</think>b<think>y</think>", "ab"),
    ],
)
def test_strip_thinking(raw: str, answer: str) -> None:
    assert strip_thinking(raw) == answer


def test_normalisation_rules() -> None:
    assert parse_answer(" Music_Play ", ["trim", "case"]) == "music_play"
    assert parse_answer(" Music_Play ", ["trim"]) == "Music_Play"
    with pytest.raises(ValueError, match="unknown normalisation rule"):
        Scoreboard(rules=["lower"])


def test_known_answers_accuracy_per_label_and_confusion() -> None:
    board = Scoreboard(rules=["trim"], top_confusions=2)
    cases = [  # (output, reference, correct)
        ("<think>\n\n</think>\n\nA", "A", True),
        ("A", "<think>\n\n</think>\n\nA", True),  # a thought in the reference is not part of the label
        ("B", "A", False),
        ("B", "A", False),
        ("C", "A", False),
        ("B", "B", True),
        ("b", "B", False),  # case matters unless the "case" rule is on
        ("C", "C", True),
    ]
    for output, reference, correct in cases:
        assert board.add(output, reference)[1] is correct
    s = board.summary()
    assert (s["total"], s["correct"], s["accuracy"]) == (8, 4, 0.5)
    assert s["per_label"]["A"] == {"total": 5, "correct": 2, "accuracy": 0.4}
    assert s["per_label"]["B"] == {"total": 2, "correct": 1, "accuracy": 0.5}
    assert s["per_label"]["C"]["accuracy"] == 1.0
    assert list(s["per_label"]) == ["A", "B", "C"]  # most frequent label first
    assert s["confusion"] == [
        {"reference": "A", "answer": "B", "count": 2},
        {"reference": "A", "answer": "C", "count": 1},
    ]


def test_case_rule_makes_matching_case_insensitive() -> None:
    board = Scoreboard(rules=["trim", "case"])
    assert board.add("Weather_Query", "weather_query") == ("weather_query", True)
    assert board.summary()["accuracy"] == 1.0


def test_empty_board() -> None:
    assert Scoreboard().summary()["accuracy"] == 0.0
