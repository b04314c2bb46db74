"""Data parallel (FSDP2 over gloo, torchrun) equals one process step by step, and a checkpoint written by two
ranks resumes on one (DCP reshards), continuing the one-process loss curve."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from train_support import metric_rows, tiny_spec, write_instruction_data

ROOT = Path(__file__).resolve().parents[2]


def _train(spec: dict, run_dir: Path, nproc: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    launcher = [sys.executable, "-m", "engine"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "engine"]
    proc = subprocess.run([*launcher, "train", "--spec", str(run_dir / "spec.json"), "--run-dir", str(run_dir)],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_fsdp_dp2_matches_one_process_and_resumes_on_one(tmp_path: Path):
    data = write_instruction_data(tmp_path / "data" / "sft")
    # fp32, 4 micro-batches of 2 per step on one process = 2 per rank on two; the sharded optimizer (ZeRO-3 style).
    spec = tiny_spec(data, train_iters=5, use_distributed_optimizer=True)
    _train({**spec, "save": str(tmp_path / "one")}, tmp_path / "run1", 1)
    _train({**spec, "save": str(tmp_path / "two"), "save_interval": 3}, tmp_path / "run2", 2)
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
    _train({**spec, "save": str(resumed_save)}, tmp_path / "run3", 1)
    after = metric_rows(tmp_path / "run3")
    assert [r["iteration"] for r in after] == [4, 5]
    for a, b in zip(one[3:], after):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
