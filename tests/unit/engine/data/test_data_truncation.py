"""Over-long instruction samples (issue 17 item 1) and ``append_eod`` for instruction data (item 4).

Expected numbers are worked out by hand from MindSpeed's rules (``mindspeed_llm/tasks/preprocess/templates.py``
``LFDefaultTemplate._make_pairs`` / ``Template._make_pairs``, ``decoder_packed_mtf_dataset.py::_infer_seqlen``,
``data_handler.py::_serialize_to_disk`` drop check and ``LlamaFactoryInstructionHandler._filter`` for
``--append-eod``); the corpus is ``tests/corpus/long_samples.jsonl`` (the pair lengths are pinned first).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.contract.indexed import InstructionDataset
from engine.contract.runfiles import RunDir
from engine.contract.spec import PreprocessSpec
from engine.data.templates import IGNORE_INDEX
from engine.data.truncation import infer_max_len, infer_seqlen, limit_sample, pairs_of
from engine.preprocess import run

CORPUS = Path(__file__).resolve().parents[3] / "corpus"
IM_END = 151645


@pytest.mark.parametrize(
    ("source", "target", "cutoff", "expected"),
    [
        (100, 10, 63, (53, 10)),  # short answer kept whole, prompt cut
        (10, 100, 63, (10, 53)),  # short prompt kept whole, answer cut
        (100, 65, 63, (39, 24)),  # both long: answer gets int(63 * 65 / 165) = 24
        (16, 4, 63, (16, 4)),  # fits: unchanged
    ],
)
def test_infer_seqlen_is_mindspeeds(source, target, cutoff, expected):
    assert infer_seqlen(source, target, cutoff) == expected


def test_infer_max_len_is_mindspeeds_older_rule():
    assert infer_max_len(100, 65, 64) == (39, 25)  # target int(64 * 65 / 165) = 25, source 64 - 25
    assert infer_max_len(16, 4, 64) == (60, 12)  # maxima only (int(64 * 4 / 20) = 12): a fitting pair is not cut
    assert infer_max_len(90, 0, 64) == (64, 1)  # reserved_label_len = 1


def test_pairs_are_masked_runs_then_trained_runs():
    labels = np.array([-100, -100, 5, 6, -100, 7, -100], np.int32)
    assert pairs_of(labels) == [(0, 2, 4), (4, 5, 6), (6, 7, 7)]


def _sample(source: int, target: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.arange(1, source + target + 1, dtype=np.int32)
    return ids, np.where(np.arange(ids.size) < source, IGNORE_INDEX, ids).astype(np.int32)


def test_qwen3_cut_keeps_both_sides_and_fits_seq_minus_one():
    ids, labels, outcome = limit_sample(*_sample(100, 65), seq_length=64, policy="truncate", template="qwen3", eod=None)
    assert outcome == "truncated" and ids.size == 63
    assert (labels == IGNORE_INDEX).sum() == 39 and (labels != IGNORE_INDEX).sum() == 24
    assert ids[:39].tolist() == list(range(1, 40)) and ids[39:].tolist() == list(range(101, 125))  # heads kept


def test_qwen_cut_reaches_seq_length_and_is_dropped_as_mindspeed_does():
    _, _, outcome = limit_sample(*_sample(100, 65), seq_length=64, policy="truncate", template="qwen", eod=None)
    assert outcome == "too_long"  # 39 + 25 = 64 >= seq_length


def test_append_eod_is_trained_and_can_push_a_cut_sample_out():
    ids, labels, outcome = limit_sample(*_sample(10, 5), seq_length=64, policy="truncate", template="qwen3", eod=IM_END)
    assert outcome is None and ids[-1] == labels[-1] == IM_END and ids.size == 16
    _, _, outcome = limit_sample(*_sample(100, 65), seq_length=64, policy="truncate", template="qwen3", eod=IM_END)
    assert outcome == "too_long"  # 63 + eod = 64: MindSpeed's writer drops it


def _spec(tmp_path, tok_dir, **over) -> PreprocessSpec:
    fields = {
        "input": str(CORPUS / "long_samples.jsonl"),
        "tokenizer_name_or_path": str(tok_dir),
        "output_prefix": str(tmp_path / "out" / "long"),
        "handler_name": "SharegptStyleInstructionHandler",
        "prompt_type": "qwen3",
        "seq_length": 64,
    }
    return PreprocessSpec(**{**fields, **over})


def _written(tmp_path) -> list[tuple[int, int]]:
    ds = InstructionDataset(tmp_path / "out" / "long")
    return [(int(ds[i].input_ids.size), int((ds[i].labels != IGNORE_INDEX).sum())) for i in range(len(ds))]


def test_corpus_pair_lengths_are_pinned(qwen_tokenizer_dir):
    from engine.data.formats import iter_conversations
    from engine.data.templates import encode_conversation
    from engine.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(qwen_tokenizer_dir))
    found = [
        [(b - a, c - b) for a, b, c in pairs_of(encode_conversation(tok, m, "qwen3", "none")[1])]
        for _, _, m in iter_conversations(CORPUS / "long_samples.jsonl")
    ]
    assert found == [[(100, 65)], [(16, 4), (67, 48)], [(13, 4)]]


def test_default_is_mindspeeds_proportional_truncation(tmp_path, qwen_tokenizer_dir):
    spec = _spec(tmp_path, qwen_tokenizer_dir)
    assert spec.overlong_policy == "truncate"
    _, summary = run(spec, RunDir(tmp_path / "run"))
    # sample 1: (100, 65) -> (39, 24); sample 2: (16, 4) kept, then 43 left: (67, 48) -> int(43*48/115) = 17, 26
    assert _written(tmp_path) == [(63, 24), (63, 4 + 17), (17, 4)]
    assert summary["truncated"] == 2 and summary["samples_dropped"] == {}


def test_drop_and_head_policies_stay_available(tmp_path, qwen_tokenizer_dir):
    _, summary = run(_spec(tmp_path, qwen_tokenizer_dir, overlong_policy="drop"), RunDir(tmp_path / "run"))
    assert _written(tmp_path) == [(17, 4)] and summary["samples_dropped"] == {"too_long": 2}
    _, summary = run(_spec(tmp_path, qwen_tokenizer_dir, overlong_policy="truncate_head"), RunDir(tmp_path / "run2"))
    # sample 1's first 63 tokens are all prompt: nothing left to train on
    assert _written(tmp_path) == [(63, 4), (17, 4)] and summary["samples_dropped"] == {"no_trained_tokens": 1}


def test_append_eod_for_instruction_data(tmp_path, qwen_tokenizer_dir):
    _, summary = run(_spec(tmp_path, qwen_tokenizer_dir, append_eod=True), RunDir(tmp_path / "run"))
    ds = InstructionDataset(tmp_path / "out" / "long")
    assert _written(tmp_path) == [(18, 5)]  # both cut samples reach 64 with the eod and are dropped
    assert ds[0].input_ids[-1] == ds[0].labels[-1] == IM_END and ds[0].attention_mask.tolist() == [1] * 18
    assert summary["samples_dropped"] == {"too_long": 2}
