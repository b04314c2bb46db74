"""The seed's full-SFT script (seed 004, tiny model, paths changed) under TP=1 PP=2, TP=2 and TP=2×PP=2 with
``python -m engine train`` under torchrun: the same losses and grad norms as one process (the CLI's main in the test's
process), and the final checkpoint in the seed's mcore layout for that TP/PP (``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``).

The flags and assets are test_train_seed_scripts.py's (the seed's lines verbatim but for the shape and paths); here
only the parallel sizes change. The seed trains in bf16, so layouts agree to bf16 rounding, not to fp32 precision
(the fp32 step-by-step parity of every layout is test_parallel_layouts.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_train_seed_scripts import FULL, _run, seed_assets  # noqa: F401  (fixture)

# the module's assets (102 s at load ~15) land on whichever test runs first, then up to 4 torchrun ranks
pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]
ITERS = 3  # enough to see the layouts stay together after optimizer steps; each CPU iteration costs seconds


def _flags(tp: int, pp: int) -> str:
    flags = FULL.replace("--train-iters {iters}", f"--train-iters {ITERS}").replace(
        "--save-interval {iters}", f"--save-interval {ITERS}"
    )
    return flags.replace("--tensor-model-parallel-size 1", f"--tensor-model-parallel-size {tp}").replace(
        "--pipeline-model-parallel-size 1", f"--pipeline-model-parallel-size {pp}"
    )


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(seed_assets: dict[str, Path]) -> list[dict]:  # noqa: F811
    _, run_dir = _run(_flags(1, 1), seed_assets, "par_ref", 1)
    return _metrics(run_dir)


@pytest.mark.parametrize(("tp", "pp", "nproc"), [(1, 2, 2), (2, 1, 2), (2, 2, 4)])
def test_seed_full_sft_parallel(
    seed_assets: dict[str, Path],  # noqa: F811
    one_process: list[dict],
    tp: int,
    pp: int,
    nproc: int,
) -> None:
    save, run_dir = _run(_flags(tp, pp), seed_assets, f"par_tp{tp}pp{pp}", nproc)
    rows = _metrics(run_dir)
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    for row, ref in zip(rows, one_process):
        assert row["lm_loss"] == pytest.approx(ref["lm_loss"], rel=2e-3), (tp, pp, row["iteration"])
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-2), (tp, pp, row["iteration"])
    summary = json.loads((run_dir / "result.json").read_text())["summary"]
    assert summary["world_size"] == nproc
    it_dir = save / f"iter_{ITERS:07d}"
    names = sorted(p.name for p in it_dir.iterdir())
    expected = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp)]
    assert names == sorted(expected)
    first = torch.load(it_dir / expected[0] / "model_optim_rng.pt", weights_only=False)
    assert first["model"]["embedding.word_embeddings.weight"].shape == (151936 // tp, 64)
    assert first["args"].tensor_model_parallel_size == tp and first["args"].pipeline_model_parallel_size == pp


def test_seed_flags_interleaved_pipeline_from_scratch(seed_assets: dict[str, Path]) -> None:  # noqa: F811
    """4 layers from the flags' shape (no load), PP=2 with --num-layers-per-virtual-pipeline-stage 1 (interleaved
    1F1B, 2 chunks per rank) equals one process; the export stores each rank's chunks as model0/model1."""
    flags = _flags(1, 1).replace("--load {load} ", "").replace("--num-layers 2 ", "--num-layers 4 ")
    _, ref_dir = _run(flags, seed_assets, "vpp_ref", 1)
    vpp = flags.replace("--pipeline-model-parallel-size 1", "--pipeline-model-parallel-size 2").replace(
        "--num-layers 4 ", "--num-layers 4 --num-layers-per-virtual-pipeline-stage 1 "
    )
    save, run_dir = _run(vpp, seed_assets, "vpp", 2)
    for row, ref in zip(_metrics(run_dir), _metrics(ref_dir), strict=True):
        assert row["lm_loss"] == pytest.approx(ref["lm_loss"], rel=2e-3)
    state = torch.load(save / f"iter_{ITERS:07d}" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    assert state["args"].num_layers_per_virtual_pipeline_stage == 1
    assert sorted(state["model0"]) == sorted(k for k in state["model0"] if k.startswith("decoder.layers.0."))
    assert "decoder.final_layernorm.weight" in state["model1"]  # stage 3 of 4 (rank 1, chunk 1) is the last
