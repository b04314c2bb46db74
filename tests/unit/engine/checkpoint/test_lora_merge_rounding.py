"""LoRA merge rounding (issue 17 item 6): ours (fp32, one rounding) by default, MindSpeed's exact arithmetic on request.

MindSpeed (``mindspeed_llm/tasks/checkpoint/convert_mg2hf.py::_merge_lora``) computes
``base + (alpha / r) * matmul(B.float(), A.float()).to(base.dtype)``: the product is rounded to bf16, scaled in bf16,
then added in bf16. The emulation below spells those three bf16 roundings out step by step in fp32/fp64.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from convert_tiny import read_hf, tiny_hf
from engine.checkpoint.hf import HFCheckpoint
from engine.checkpoint.job import run
from engine.checkpoint.megatron_write import save_mcore
from engine.contract.runfiles import RunDir
from engine.contract.spec import ConvertSpec
from engine.model.lora import merge_lora_rounded

SCALE_ALPHA, SCALE_R = 16.0, 8


def _tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (0.05 * torch.randn(96, 64, generator=g)).to(torch.bfloat16)
    a = (0.05 * torch.randn(8, 64, generator=g)).to(torch.bfloat16)
    b = (0.05 * torch.randn(96, 8, generator=g)).to(torch.bfloat16)
    return w, a, b


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def test_default_rounds_once_and_mindspeed_three_times():
    w, a, b = _tensors()
    scale = SCALE_ALPHA / SCALE_R
    exact = w.double() + scale * (b.double() @ a.double())
    ours = merge_lora_rounded(w, a, b, SCALE_ALPHA, SCALE_R)
    theirs = merge_lora_rounded(w, a, b, SCALE_ALPHA, SCALE_R, "mindspeed")
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours.float(), _bf16(exact))  # one rounding of the (fp32-exact here) sum
    steps = _bf16(w.float() + _bf16(scale * _bf16(b.float() @ a.float())))  # cast, scale, add: each in bf16
    assert torch.equal(theirs.float(), steps)
    differ = (ours != theirs).float().mean().item()
    assert 0.02 < differ < 0.5, differ  # a share of the merged weights differ by a rounding step
    assert (ours.double() - exact).abs().mean() < (theirs.double() - exact).abs().mean()


def test_unknown_rounding_is_refused():
    w, a, b = _tensors()
    with pytest.raises(ValueError, match="lora_merge_rounding"):
        merge_lora_rounded(w, a, b, 1.0, 1, "bf16")


@pytest.fixture(scope="module")
def unified(tmp_path_factory):
    """A bf16 MindSpeed 'unified' LoRA checkpoint (base_layer + lora_A/B.default) on one module, TP1/PP1."""
    root = tmp_path_factory.mktemp("rounding")
    src = HFCheckpoint(tiny_hf(root / "hf", tied=True, dtype=torch.bfloat16, layers=2))
    save_mcore(src, src.config, root / "base", tp=1, pp=1)
    shutil.copytree(root / "base", root / "lora")
    path = root / "lora" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    g = torch.Generator().manual_seed(1)
    a = (0.05 * torch.randn(SCALE_R, 96, generator=g)).to(torch.bfloat16)  # linear_fc2: [hidden 64, ffn 96]
    b = (0.05 * torch.randn(64, SCALE_R, generator=g)).to(torch.bfloat16)
    module = "decoder.layers.1.mlp.linear_fc2"
    state["model"][module + ".base_layer.weight"] = state["model"].pop(module + ".weight")
    state["model"][module + ".lora_A.default.weight"] = a
    state["model"][module + ".lora_B.default.weight"] = b
    torch.save(state, path)
    return root, a, b


@pytest.mark.parametrize("rounding", ["fp32", "mindspeed"])
def test_convert_applies_the_chosen_rounding(unified, rounding):
    root, a, b = unified
    spec = ConvertSpec(
        load_model_type="mg",
        save_model_type="hf",
        load_dir=str(root / "lora"),
        save_dir=str(root / f"out-{rounding}"),
        lora_r=SCALE_R,
        lora_alpha=SCALE_ALPHA,
        **({} if rounding == "fp32" else {"lora_merge_rounding": rounding}),
    )
    assert spec.lora_merge_rounding == rounding
    run(spec, RunDir(root / f"run-{rounding}"))
    base = read_hf(root / "hf")["model.layers.1.mlp.down_proj.weight"]
    merged = read_hf(root / f"out-{rounding}")["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(merged, merge_lora_rounded(base, a, b, SCALE_ALPHA, SCALE_R, rounding))
    other = "mindspeed" if rounding == "fp32" else "fp32"
    assert not torch.equal(merged, merge_lora_rounded(base, a, b, SCALE_ALPHA, SCALE_R, other))
