"""The planner's largest micro-batch (``engine.contract.plan.data_shape``, torch-free, index only) equals the largest one the
trainer really forms from the same data, in every batching mode, and its any-order bound is never below it."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))
from engine.contract.indexed import IndexedDatasetWriter, boundaries_prefix, instruction_prefix  # noqa: E402
from engine.contract.plan import data_shape  # noqa: E402
from engine.train.batches import collate, collate_pairs  # noqa: E402
from engine.train.data import TrainData, rank_micro_batches  # noqa: E402
from train_support import write_instruction_data, write_pairwise_data  # noqa: E402

SEQ = 24


def _spec(prefix: str, **kw: object) -> types.SimpleNamespace:
    base = dict(
        kind="train",
        data_path=[prefix],
        split="90,10,0",
        seed=7,
        is_pairwise_dataset=False,
        padding_free=True,
        variable_seq_lengths=False,
        stage="sft",
        micro_batch_size=4,
        train_iters=6,
    )
    return types.SimpleNamespace(**{**base, **kw})


def _engine_largest(spec: types.SimpleNamespace, gbs: int, dp: int) -> int:
    """The largest micro-batch (padded token positions) the trainer forms over the whole run, every DP rank."""
    data = TrainData.open(spec.data_path, spec.split, spec.seed, SEQ, pairwise=spec.is_pairwise_dataset)
    largest = 0
    for it in range(1, spec.train_iters + 1):
        for rank in range(dp):
            for group in rank_micro_batches(data, it, gbs, spec.micro_batch_size, dp, rank):
                if spec.stage == "dpo":
                    mb = collate_pairs(group, SEQ, spec.variable_seq_lengths)
                else:
                    mb = collate(group, SEQ, spec.padding_free, spec.variable_seq_lengths)
                largest = max(largest, mb.input_ids.numel())
    return largest


def _packed_rows(prefix: Path, rows: int = 30, seed: int = 3) -> str:
    """Pre-packed instruction rows with our boundaries index: 1-3 sub-samples of 3-20 tokens each."""
    rng = np.random.default_rng(seed)
    writers = {
        f: IndexedDatasetWriter(instruction_prefix(prefix, f)) for f in ("input_ids", "attention_mask", "labels")
    }
    bounds = IndexedDatasetWriter(boundaries_prefix(prefix), dtype=np.int64)
    for _ in range(rows):
        subs = rng.integers(3, 21, int(rng.integers(1, 4)))
        ids = rng.integers(1, 500, int(subs.sum()))
        writers["input_ids"].add_document(ids)
        writers["labels"].add_document(ids)
        writers["attention_mask"].add_document(np.ones(ids.size))
        bounds.add_document(np.cumsum(subs))
    for w in [*writers.values(), bounds]:
        w.finalize()
    return str(prefix)


def _text(prefix: Path, docs: int = 20, seed: int = 5) -> str:
    """Pretraining documents of 2-70 tokens: the long ones are cut into windows."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(str(prefix) + "_text_document")
    for n in rng.integers(2, 71, docs):
        writer.add_document(rng.integers(1, 500, int(n)))
    writer.finalize()
    return str(prefix)


@pytest.mark.parametrize(
    ("data", "mode"),
    [
        ("instruction", {}),
        ("instruction", {"padding_free": False, "variable_seq_lengths": True}),
        ("instruction", {"padding_free": False}),
        ("packed", {}),
        ("packed", {"padding_free": False, "variable_seq_lengths": True}),
        ("text", {}),
        ("text", {"padding_free": False, "variable_seq_lengths": True}),
        ("pairs", {"stage": "dpo", "is_pairwise_dataset": True, "variable_seq_lengths": True}),
    ],
)
@pytest.mark.parametrize("dp", [1, 2])
def test_replayed_largest_micro_batch_is_the_engines(tmp_path: Path, data: str, mode: dict, dp: int) -> None:
    writers = {
        "instruction": lambda p: write_instruction_data(p, n=40),
        "packed": _packed_rows,
        "text": _text,
        "pairs": lambda p: write_pairwise_data(p, n=30),
    }
    prefix = writers[data](tmp_path / "d")
    spec = _spec(prefix, **mode)
    gbs = spec.micro_batch_size * dp * 2
    found = data_shape.largest_micro_batch(spec, gbs, SEQ)
    assert found is not None and found.position is not None
    assert found.tokens == _engine_largest(spec, gbs, dp)
    bound = data_shape._any_order(data_shape._train_rows(spec, SEQ), spec, SEQ)
    assert bound.tokens >= found.tokens and bound.position is None


def test_long_runs_are_bounded_over_any_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = write_instruction_data(tmp_path / "d", n=40)
    spec = _spec(prefix)
    monkeypatch.setattr(data_shape, "REPLAY_LIMIT", 8)
    found = data_shape.largest_micro_batch(spec, 8, SEQ)
    assert found is not None and found.position is None
    lengths = np.sort(np.minimum(np.diff(np.r_[0, np.cumsum([len(s.input_ids) for s in _rows(prefix)])]), SEQ) - 1)
    assert found.tokens == int(lengths[-spec.micro_batch_size :].sum())  # the four heaviest samples packed together


def _rows(prefix: str) -> list:
    data = TrainData.open([prefix], "90,10,0", 7, SEQ)
    return [s for i in range(data.num_samples) for s in data._row(i)]


def test_unreadable_data_leaves_the_worst_case(tmp_path: Path) -> None:
    assert data_shape.largest_micro_batch(_spec(str(tmp_path / "missing")), 8, SEQ) is None
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    (tmp_path / "bad.bin").write_bytes(b"")
    assert data_shape.largest_micro_batch(_spec(str(tmp_path / "bad")), 8, SEQ) is None
    assert data_shape.largest_micro_batch(_spec(str(tmp_path / "bad"), split="0,1,0"), 8, SEQ) is None


def test_engine_refuses_a_micro_batch_beyond_the_admitted_one(tmp_path: Path) -> None:
    """The data changed after admission: the first micro-batch over ``max_micro_batch_tokens`` fails the job as bad
    input naming its dataset rows (exit 2), before any step could run out of memory. Through the CLI's ``main`` in
    this process: ``python -m engine`` only raises SystemExit with its code (run_train's one-process runs start it)."""
    from engine.cli import main
    from train_support import tiny_spec

    prefix = write_instruction_data(tmp_path / "d", n=16)
    (tmp_path / "spec.json").write_text(json.dumps(tiny_spec(prefix, max_micro_batch_tokens=20, train_iters=1)))
    assert main(["train", "--spec", str(tmp_path / "spec.json"), "--run-dir", str(tmp_path / "run")]) == 2
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    error = next(e["message"] for e in events if e["type"] == "error")
    assert "micro-batch 0 (dataset rows [" in error and "max_micro_batch_tokens" in error, error
