"""Expert parallelism on four ranks (EP 2 × expert-data-parallel 2, ``expert_parallel_worker.py``): each rank holds
only its experts (E/EP, then cut by FSDP), filled with the full model's rows; every other weight shards over all of
DP; with token dropping on, logits and expert gradients equal the whole model's on the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("expert_parallel_worker.py")
REPO = WORKER.parents[2]


@pytest.mark.slow
def test_ep2_edp2_shards_experts_and_dispatches_exactly(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(WORKER), str(out)]
    proc = subprocess.run([*cmd, "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["errors"] == []
    assert result["dropped"] > 0  # the capacity path ran
    # 8 experts / EP 2 / edp 2 = 2 rows per rank, for each of the 2 MoE layers' 2 stacked weights on 4 ranks
    assert result["local_rows"] == [2] * 16
