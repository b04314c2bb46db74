"""Meta-built, sharded-loaded models equal the full build bit for bit after loading, under every layout.

Each launch runs several layouts in one torchrun (``sharded_build_worker.py``): every rank builds its part the
trainer's way (``build_rank_model``) and the old way (whole fp32 model on the host, split and sharded afterwards)
and compares every local parameter exactly. Sources: the seeded initial weights, an HF directory, Megatron mcore
checkpoints of the run's own layout (each rank provably opens exactly its own ``mp_rank_TT_PPP`` file) and of
another one (re-sliced from the files holding the rank's layers only).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrun_support import launch_worker

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("sharded_build_worker.py")


def launch(tmp_path: Path, nproc: int, *cases: str) -> dict:
    return launch_worker(WORKER, nproc, tmp_path / f"result-{nproc}.json", str(tmp_path), *cases)


def assert_equal(result: dict, cases: list[str]) -> None:
    assert sorted(result) == sorted(c.split(":")[0] for c in cases)
    for name, entry in result.items():
        assert entry["mismatches"] == [], f"{name}: {entry['mismatches']}"
        assert min(entry["params"]) > 0


def test_two_process_layouts(tmp_path: Path) -> None:
    cases = [
        "dp2:dp=2",
        "tp2:tp=2",
        "pp2_tied:pp=2,tied=1",
        "pp2_interleaved:pp=2,vpp=1,tied=1",
        "lora_tp2:tp=2,lora=1",
        "lora_pp2_hf:pp=2,lora=1,tied=1,src=hf",
        "hf_tp2:tp=2,src=hf",
        "mcore_tp2:tp=2,src=mcore,ctp=2",
        "mcore_pp2_resliced:pp=2,src=mcore,ctp=2",
        "bf16_dp2_recompute:dp=2,bf16=1,ac=full",
    ]
    assert_equal(launch(tmp_path, 2, *cases), cases)


def test_four_process_layouts(tmp_path: Path) -> None:
    cases = [
        "tp2pp2_tied:tp=2,pp=2,tied=1",
        "tp2dp2_lora:tp=2,dp=2,tied=1,lora=1",
        "pp2dp2_vpp:pp=2,dp=2,vpp=1",
        "mcore_tp2pp2_own:tp=2,pp=2,src=mcore,ctp=2,cpp=2,tied=1",
        "mcore_tp2pp2_resliced:tp=2,pp=2,src=mcore,ctp=1,cpp=4",
    ]
    result = launch(tmp_path, 4, *cases)
    assert_equal(result, cases)
    # Same layout: each rank opened exactly its own file (ranks are tp-fastest: rank = pp_rank * 2 + tp_rank).
    own = [f"mp_rank_{r % 2:02d}_{r // 2:03d}/model_optim_rng.pt" for r in range(4)]
    assert result["mcore_tp2pp2_own"]["opened"] == [[name] for name in own]
    # TP1 × PP4 re-sliced to TP2 × PP2: a stage's two layers live in two of the four files, which both TP ranks read.
    stage_files = [[f"mp_rank_00_{s:03d}/model_optim_rng.pt" for s in (2 * p, 2 * p + 1)] for p in (0, 0, 1, 1)]
    assert [sorted(files) for files in result["mcore_tp2pp2_resliced"]["opened"]] == stage_files
