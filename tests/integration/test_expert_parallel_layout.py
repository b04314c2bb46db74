"""Expert parallelism on four ranks (EP 2 × expert-data-parallel 2, ``expert_parallel_worker.py``): each rank holds
only its experts (E/EP, then cut by FSDP), filled with the full model's rows; every other weight shards over all of
DP; with token dropping on, logits and expert gradients equal the whole model's on the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrun_support import launch_worker

WORKER = Path(__file__).with_name("expert_parallel_worker.py")


@pytest.mark.slow
def test_ep2_edp2_shards_experts_and_dispatches_exactly(tmp_path: Path) -> None:
    result = launch_worker(WORKER, 4, tmp_path / "result.json", "2")
    assert result["errors"] == []
    assert result["dropped"] > 0  # the capacity path ran
    # 8 experts / EP 2 / edp 2 = 2 rows per rank, for each of the 2 MoE layers' 2 stacked weights on 4 ranks
    assert result["local_rows"] == [2] * 16
