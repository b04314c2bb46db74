"""The precision-aware optimizer and its offload under DP2 (FSDP2, distributed optimizer), TP2 (SP) and PP2 on gloo
equal one process, through the trainer itself (``python -m engine train`` under torchrun, 5 steps of the tiny model;
the one-process reference runs the same runner in the test's process),
and resume bit-identically under DP2 (issue 42).

- fp32 compute, bf16 moments, the whole optimizer state offloaded: losses and grad norms within the tolerance of the
  fp32 layout tests (relative 1e-5, ``test_parallel_layouts.py``); likewise LoRA with bf16 moments and half offloaded.
- bf16 compute with bf16 main grads and bf16 moments: within bf16 compute's own layout noise (plain bf16 AdamW
  measured against one process here: loss 4.7e-5, grad norm 3.6e-3 relative at worst, TP2), hence ``BF16_RTOL``.
  Under DP2 the offloaded run equals the device run bit for bit, and both resume bit for bit from their step-3
  checkpoints.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from train_support import metric_rows, run_train, tiny_spec, train_in_process, write_instruction_data

# each test launches 4-7 trainings under torchrun (20-40 s each under CI's load; 180 s was hit once at load ~20)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RTOL = 1e-5
BF16_RTOL = {"lm_loss": 2e-4, "grad_norm": 1e-2}
BF16_MOMENTS = {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
BF16_ALL = {"bf16": True, "main_grads_dtype": "bf16", **BF16_MOMENTS}
OFFLOAD = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "one": (1, {}),
    "dp2": (2, {"use_distributed_optimizer": True}),
    "tp2": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_instruction_data(tmp_path_factory.mktemp("data") / "sft")


def train(data: str, run: Path, layout: str, **flags: Any) -> list[dict[str, Any]]:
    """The layout's run: the one-process reference in this process (a torchrun's interpreter start is most of a
    5-step run's time), the others under torchrun."""
    nproc, parallel = LAYOUTS[layout]
    spec = tiny_spec(data, train_iters=5, lr=1e-3, **parallel, **flags)
    if nproc == 1:
        return train_in_process(spec, run)
    run_train(spec, run, nproc)
    return metric_rows(run)


def assert_close(rows: list[dict[str, Any]], ref: list[dict[str, Any]], rtol: dict[str, float], name: str) -> None:
    assert len(rows) == len(ref) == 5
    for step, (got, want) in enumerate(zip(rows, ref)):
        for key, tol in rtol.items():
            assert got[key] == pytest.approx(want[key], rel=tol), f"{name} step {step}: {key} {got[key]} vs {want[key]}"


def exact(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    return [(r["lm_loss"], r["grad_norm"]) for r in rows]


def resume(data: str, tmp_path: Path, saved: Path, name: str, layout: str, **flags: Any) -> list[dict[str, Any]]:
    """The run re-queued from the step-3 checkpoint in ``saved`` (its only one: 5 is not a multiple of 3)."""
    again = tmp_path / f"{name}_save"
    shutil.copytree(saved / "train_state", again / "train_state")
    return train(data, tmp_path / name, layout, save=str(again), **flags)


def test_fp32_compute_bf16_moments_offloaded_layouts_equal_one_process(data: str, tmp_path: Path):
    flags = {**BF16_MOMENTS, **OFFLOAD}
    ref = train(data, tmp_path / "one", "one", **flags)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"]
    for layout in ("dp2", "tp2", "pp2"):
        rows = train(data, tmp_path / layout, layout, **flags)
        assert_close(rows, ref, {"lm_loss": RTOL, "grad_norm": RTOL}, layout)


def test_lora_bf16_moments_half_offloaded_layouts_equal_one_process(data: str, tmp_path: Path):
    flags = {**BF16_MOMENTS, "optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5, "lora_r": 4}
    ref = train(data, tmp_path / "one", "one", **flags)
    for layout in ("dp2", "tp2"):
        rows = train(data, tmp_path / layout, layout, **flags)
        assert_close(rows, ref, {"lm_loss": RTOL, "grad_norm": RTOL}, layout)


def test_bf16_grads_and_moments_layouts_offload_and_dp2_resume(data: str, tmp_path: Path):
    ref = train(data, tmp_path / "one", "one", **BF16_ALL)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"]
    runs = {}
    for layout in ("dp2", "tp2", "pp2"):
        save = {"save": str(tmp_path / "dp2_save"), "save_interval": 3} if layout == "dp2" else {}
        runs[layout] = train(data, tmp_path / layout, layout, **BF16_ALL, **save)
        assert_close(runs[layout], ref, BF16_RTOL, layout)
    # grad norms are fp32 (Megatron's get_grad_norm_fp32) from the bf16 grads, not bf16-rounded
    assert all(torch.tensor(r["grad_norm"]).bfloat16().item() != r["grad_norm"] for r in ref + runs["dp2"])

    # the offloaded DP2 run is the device DP2 run, bit for bit (same arithmetic, on the host)
    offloaded_save = {"save": str(tmp_path / "off_save"), "save_interval": 3}
    offloaded = train(data, tmp_path / "dp2_offload", "dp2", **BF16_ALL, **OFFLOAD, **offloaded_save)
    assert exact(offloaded) == exact(runs["dp2"])

    # each resumes from its step-3 checkpoint under DP2 with the uninterrupted run's steps 4 and 5, bit for bit
    for name, saved, flags in (("dp2", "dp2_save", BF16_ALL), ("off", "off_save", {**BF16_ALL, **OFFLOAD})):
        after = resume(data, tmp_path, tmp_path / saved, f"{name}_resumed", "dp2", **flags)
        assert [r["iteration"] for r in after] == [4, 5]
        assert exact(after) == exact(runs["dp2"][3:]), name
