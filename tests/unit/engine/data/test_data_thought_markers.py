"""Thought markers in MindSpeed's spelling only (issue 17 item 5); corpus ``tests/corpus/thought_markers.jsonl``.

MindSpeed's ``ReasoningTemplate`` (``mindspeed_llm/tasks/preprocess/templates.py``) sees a thought only when the
response contains ``thought_words[0]`` = ``<think>\\n`` or ``thought_words[1]`` = ``\\n</think>\\n\\n``, and
``remove_thought`` (enable_thinking false) deletes only ``<think>\\n…\\n</think>\\n\\n``. Expected rows below are the
pieces MindSpeed tokenizes one by one (user turn with header, [empty thought], response + ``<|im_end|>\\n``), written
out by hand per mode.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.data.formats import iter_conversations
from engine.data.templates import IGNORE_INDEX, encode_conversation
from engine.data.tokenizer import load_tokenizer

CORPUS = Path(__file__).resolve().parents[3] / "corpus" / "thought_markers.jsonl"
EMPTY = "<think>\n\n</think>\n\n"


def user(q: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


# row -> mode -> list of (piece, trained)
EXPECTED = {
    0: {
        "true": [(user("Q1"), False), (EMPTY, True), ("<think>short</think>Answer.<|im_end|>\n", True)],
        "none": [(user("Q1"), False), (EMPTY, False), ("<think>short</think>Answer.<|im_end|>\n", True)],
        "false": [(user("Q1"), False), (EMPTY, False), ("<think>short</think>Answer.<|im_end|>\n", True)],
    },
    1: {
        "true": [(user("Q2"), False), ("<think>\nreason\n</think>\n\nAnswer.<|im_end|>\n", True)],
        "none": [(user("Q2"), False), ("<think>\nreason\n</think>\n\nAnswer.<|im_end|>\n", True)],
        "false": [(user("Q2"), False), (EMPTY, False), ("Answer.<|im_end|>\n", True)],
    },
    2: {
        "true": [(user("Q3"), False), ("<think>\nhalf</think>Answer.<|im_end|>\n", True)],
        "none": [(user("Q3"), False), ("<think>\nhalf</think>Answer.<|im_end|>\n", True)],
        "false": [(user("Q3"), False), ("<think>\nhalf</think>Answer.<|im_end|>\n", True)],
    },
}


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir):
    return load_tokenizer(str(qwen_tokenizer_dir))


@pytest.mark.parametrize("mode", ["true", "none", "false"])
@pytest.mark.parametrize("row", [0, 1, 2], ids=["no_newlines", "canonical", "opening_word_only"])
def test_thought_markers_follow_mindspeeds_thought_words(tok, row, mode):
    messages = list(iter_conversations(CORPUS))[row][2]
    ids, labels = encode_conversation(tok, messages, "qwen3", mode)
    expected_ids, expected_labels = [], []
    for piece, trained in EXPECTED[row][mode]:
        piece_ids = tok(piece, add_special_tokens=False)["input_ids"]
        expected_ids += piece_ids
        expected_labels += piece_ids if trained else [IGNORE_INDEX] * len(piece_ids)
    assert ids.tolist() == expected_ids
    assert labels.tolist() == expected_labels
