"""Data parallel (FSDP2 over gloo, torchrun) equals one process step by step, and a checkpoint written by two
ranks resumes on one (DCP reshards), continuing the one-process loss curve."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from train_support import metric_rows, run_train, tiny_spec, train_in_process, write_instruction_data


@pytest.mark.slow
def test_fsdp_dp2_matches_one_process_and_resumes_on_one(tmp_path: Path):
    data = write_instruction_data(tmp_path / "data" / "sft")
    # fp32, 4 micro-batches of 2 per step on one process = 2 per rank on two; the sharded optimizer (ZeRO-3 style).
    spec = tiny_spec(data, train_iters=5, use_distributed_optimizer=True)
    train_in_process({**spec, "save": str(tmp_path / "one")}, tmp_path / "run1")  # the one process: this one
    run_train({**spec, "save": str(tmp_path / "two"), "save_interval": 3}, tmp_path / "run2", 2)
    one, two = metric_rows(tmp_path / "run1"), metric_rows(tmp_path / "run2")
    assert len(one) == len(two) == 5
    for a, b in zip(one, two):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["tokens"] == a["tokens"] and b["loss_tokens"] == a["loss_tokens"]
    assert one[-1]["lm_loss"] < one[0]["lm_loss"]

    # The 2-rank checkpoint of iteration 3 (its only one: 5 is not a multiple of 3), picked up by a re-queued job
    # that got only one process.
    resumed_save = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two" / "train_state", resumed_save / "train_state")
    train_in_process({**spec, "save": str(resumed_save)}, tmp_path / "run3")
    after = metric_rows(tmp_path / "run3")
    assert [r["iteration"] for r in after] == [4, 5]
    for a, b in zip(one[3:], after):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
