"""Expert parallelism as a job: EP2 (two ranks, dp 2 = edp 1 × ep 2) equals one process step for step (loss, grad
norm, router figures) over 5 fp32 steps, exports the same Megatron and HF files, resumes from its own checkpoint as
if never stopped (on two ranks, and resharded onto one), and trains LoRA on the experts (adapters split with them)
from an HF checkpoint each rank reads only its experts of."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from moe_support import write_hf_moe_dir  # noqa: E402

from train_support import (  # noqa: E402
    TINY_SHAPE,
    metric_rows,
    run_train,
    tiny_spec,
    train_in_process,
    write_instruction_data,
)

MOE_FLAGS = {
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
    "moe_layer_freq": [1, 0],
    "moe_aux_loss_coeff": 0.01,
    "norm_topk_prob": True,
}
EP2 = {"expert_model_parallel_size": 2, "resources": {"nproc_per_node": 2}}
ROUTER_KEYS = ("load_balancing_loss", "expert_load_imbalance_max", "dropped_token_fraction")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_instruction_data(tmp_path_factory.mktemp("data") / "sft", n=24)


def _same_steps(one: list[dict], two: list[dict], keys: tuple[str, ...]) -> None:
    assert [r["iteration"] for r in one] == [r["iteration"] for r in two]
    for a, b in zip(one, two, strict=True):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-6), key


def _rank_file(save: Path, iteration: int) -> dict:
    return torch.load(save / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)


@pytest.mark.slow
def test_ep2_equals_one_process_exports_the_same_and_resumes(data: str, tmp_path: Path) -> None:
    spec = tiny_spec(data, **MOE_FLAGS, train_iters=5, save_hf=True)
    one = train_in_process({**spec, "save": str(tmp_path / "s1")}, tmp_path / "one")
    run_train({**spec, **EP2, "save": str(tmp_path / "s2"), "save_interval": 3}, tmp_path / "ep2", 2)
    two = metric_rows(tmp_path / "ep2")
    assert len(one) == 5
    _same_steps(one, two, (*ROUTER_KEYS, "expert_load_imbalance_layer_0"))

    # the final export: the same files (one mp_rank_00, EP 1 args), the same tensors up to the run's rounding
    a, b = _rank_file(tmp_path / "s1", 5), _rank_file(tmp_path / "s2", 5)
    assert vars(a["args"]) == vars(b["args"]) and a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(b["model"][key], value, rtol=0, atol=1e-6)
    assert sorted(p.name for p in (tmp_path / "s1" / "hf").iterdir()) == sorted(
        p.name for p in (tmp_path / "s2" / "hf").iterdir()
    )
    assert [p.name for p in (tmp_path / "s2" / "iter_0000005").iterdir()] == ["mp_rank_00"]

    # a re-queued EP2 job continues from the EP2 checkpoint of iteration 3 as if it had never stopped
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "s2" / "train_state", resumed / "train_state")
    run_train({**spec, **EP2, "save": str(resumed), "save_hf": False}, tmp_path / "again", 2)
    _same_steps(two[3:], metric_rows(tmp_path / "again"), ROUTER_KEYS)
    # and a re-queued job that got one process reshards it (DCP), continuing the one-process curve
    single = tmp_path / "single"
    shutil.copytree(tmp_path / "s2" / "train_state", single / "train_state")
    _same_steps(
        one[3:], train_in_process({**spec, "save": str(single), "save_hf": False}, tmp_path / "on_one"), ROUTER_KEYS
    )


@pytest.mark.slow
def test_ep2_lora_on_experts_from_hf_equals_one_process(data: str, tmp_path: Path) -> None:
    hf_dir = write_hf_moe_dir(tmp_path / "hf")
    spec = tiny_spec(
        data, load=str(hf_dir), finetune=True, lora_r=4, lora_alpha=8, lr=3e-2, train_iters=5, moe_aux_loss_coeff=0.01
    )
    for key in TINY_SHAPE:  # the shape comes from the checkpoint
        spec.pop(key)
    one = train_in_process({**spec, "save": str(tmp_path / "s1")}, tmp_path / "one")
    run_train({**spec, **EP2, "save": str(tmp_path / "s2")}, tmp_path / "ep2", 2)
    two = metric_rows(tmp_path / "ep2")
    assert one[-1]["lm_loss"] < one[0]["lm_loss"]
    _same_steps(one, two, (*ROUTER_KEYS, "expert_load_imbalance_layer_0", "expert_load_imbalance_layer_1"))
    a, b = _rank_file(tmp_path / "s1", 5)["model"], _rank_file(tmp_path / "s2", 5)["model"]
    assert a.keys() == b.keys() and "decoder.layers.0.mlp.experts.linear_fc1.lora_A.default.weight" in a
    assert b["decoder.layers.1.mlp.experts.linear_fc2.lora_B.default.weight"].shape == (4, 32, 4)  # every expert
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=0, atol=1e-6)


def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from engine.checkpoint.hf import HFCheckpoint

    ckpt = HFCheckpoint(str(path))
    return {k: ckpt.get(k) for k in ckpt.keys()}  # noqa: SIM118  (a checkpoint, not a dict)


@pytest.mark.slow
@pytest.mark.timeout(240)  # four layouts of up to eight ranks: 69 s under CI load
def test_ep2_with_tp2_with_pp2_and_with_both_jobs_equal_one_process(data: str, tmp_path: Path) -> None:
    """EP2×TP2 (sequence parallel) and EP2×PP2 jobs on four ranks and an EP2×TP2×PP2 job on eight (dp 2 = ep 2):
    built on meta, each rank filling only its experts' rows (their TP slice under TP), equal one process step for
    step (loss, grad norm, router figures) and write the same final HF export."""
    spec = tiny_spec(data, **MOE_FLAGS, train_iters=3, save_hf=True, padding_free=False)
    four = {"expert_model_parallel_size": 2, "resources": {"nproc_per_node": 4}}
    eight = {"expert_model_parallel_size": 2, "resources": {"nproc_per_node": 8}}
    one = train_in_process({**spec, "save": str(tmp_path / "one" / "save")}, tmp_path / "one")
    runs = {
        "ep2tp2": ({**spec, **four, "tensor_model_parallel_size": 2, "sequence_parallel": True}, 4),
        "ep2pp2": ({**spec, **four, "pipeline_model_parallel_size": 2}, 4),
        "ep2tp2pp2": ({**spec, **eight, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, 8),
    }
    for name, (run_spec, nproc) in runs.items():
        run_train({**run_spec, "save": str(tmp_path / name / "save")}, tmp_path / name, nproc)
    expected = _hf_tensors(tmp_path / "one" / "save" / "hf")
    for name in ("ep2tp2", "ep2pp2", "ep2tp2pp2"):
        rows = metric_rows(tmp_path / name)
        assert len(rows) == len(one) == 3
        _same_steps(one, rows, (*ROUTER_KEYS, "expert_load_imbalance_layer_0"))
        exported = _hf_tensors(tmp_path / name / "save" / "hf")
        assert exported.keys() == expected.keys()
        for key, value in expected.items():  # 3 AdamW steps: fp32 summation-order differences, as test_train_moe
            torch.testing.assert_close(exported[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
