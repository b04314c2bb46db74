"""Validation during training: the split's validation share is scored every ``eval_interval`` iterations and at the
end, with the loss `transformers` gives on the same samples; pipeline- and tensor-parallel runs score it as one
process does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine.contract.indexed import InstructionDataset
from engine.contract.lengths import split_counts
from engine.contract.runfiles import RunDir
from engine.contract.spec import parse_spec
from engine.train import entry
from train_support import run_train, tiny_spec, train_in_process, write_instruction_data


def _validation_rows(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step": x["step"], **x["metrics"]} for x in lines if "val_lm_loss" in x["metrics"]]


def _spec(data: str, save: Path) -> dict:
    # 48 samples, split 2:1 -> 32 train, 16 validation = two global batches of 8
    return tiny_spec(data, split="2,1,0", train_iters=4, eval_interval=2, eval_iters=5, save=str(save), save_hf=True)


def _hf_loss(model_dir: Path, prefix: str, rows: range) -> float:
    """Mean token CE of the samples, each on its own, by transformers (it shifts the labels itself)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dataset = InstructionDataset(prefix)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in rows:
            row = dataset[i]
            ids = torch.tensor(row.input_ids, dtype=torch.long)[None]
            labels = torch.tensor(row.labels, dtype=torch.long)[None]
            n = int((labels[0, 1:] != -100).sum())
            total += float(model(input_ids=ids, labels=labels).loss) * n
            tokens += n
    return total / tokens


def test_validation_share_is_scored_every_interval_and_at_the_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = write_instruction_data(tmp_path / "data" / "sft")
    assert split_counts(48, "2,1,0") == (32, 16) and split_counts(48, "100,0,0") == (48, 0)
    assert split_counts(1000, "969, 30, 1") == (969, 30)  # Megatron's default split
    with caplog.at_level(logging.INFO, logger="engine.train"):
        _, summary = entry.run(parse_spec(_spec(data, tmp_path / "ckpt")), RunDir(tmp_path / "run"))
    rows = _validation_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [2, 4]
    assert all(r["val_loss_tokens"] == rows[0]["val_loss_tokens"] > 0 for r in rows)  # the same samples each time
    assert rows[-1]["val_lm_loss"] < rows[0]["val_lm_loss"]  # the answers are learnable: validation improves
    assert summary["validation_samples"] == 16 and summary["final_val_lm_loss"] == rows[-1]["val_lm_loss"]
    # the last pass used the final weights: transformers on the exported model gives the same loss
    expected = _hf_loss(tmp_path / "ckpt" / "hf", data, range(32, 48))
    assert rows[-1]["val_lm_loss"] == pytest.approx(expected, rel=1e-5)
    assert "validation loss at iteration 4 | lm loss value:" in caplog.text  # Megatron's line


@pytest.mark.slow
def test_pipeline_and_tensor_parallel_validation_equal_one_process(tmp_path: Path) -> None:
    data = write_instruction_data(tmp_path / "data" / "sft")
    # the one-process reference in this process: a fresh interpreter's imports are most of a 4-iteration run
    train_in_process(_spec(data, tmp_path / "ckpt-one"), tmp_path / "one")
    runs = {"one": _validation_rows(tmp_path / "one")}
    for name, extra in (("pp2", {"pipeline_model_parallel_size": 2}), ("tp2", {"tensor_model_parallel_size": 2})):
        run_dir = tmp_path / name
        run_train({**_spec(data, tmp_path / f"ckpt-{name}"), **extra}, run_dir, 2)
        runs[name] = _validation_rows(run_dir)
    for name in ("pp2", "tp2"):
        assert [r["step"] for r in runs[name]] == [r["step"] for r in runs["one"]] == [2, 4]
        for a, b in zip(runs["one"], runs[name]):
            assert b["val_loss_tokens"] == a["val_loss_tokens"]
            assert b["val_lm_loss"] == pytest.approx(a["val_lm_loss"], rel=1e-5), name
