"""The model-family seam: torch-free descriptors (engine.contract.families) and their runtime builders
(engine.model.families); the planner reads a family's anatomy. Submission refusing another family by name:
tests/unit/app/test_submission_mistakes.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.contract import families
from engine.contract.families import FAMILIES, UnknownFamily, family_of_hf
from engine.contract.model_config import ModelConfig, preset
from engine.contract.plan.memory import Layout, layer_activation_bytes, layer_params
from engine.model.families import BUILDERS, build_model


def test_every_family_has_both_halves() -> None:
    assert set(FAMILIES) == set(BUILDERS) == {"qwen3", "qwen3_moe"}


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_hf_config_round_trip_keeps_the_family(name: str) -> None:
    cfg = preset(name)
    hf = cfg.to_hf()
    fam = family_of_hf(hf)
    assert fam is cfg.family and hf["model_type"] == fam.hf_model_type == fam.name
    assert hf["architectures"] == [fam.hf_architecture]
    assert ModelConfig.from_hf(hf) == cfg


def test_an_unknown_model_type_is_refused_by_name() -> None:
    hf = {**preset("qwen3-tiny").to_hf(), "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(
        UnknownFamily, match="model_type 'llama' is not a supported model family \\(qwen3, qwen3_moe\\)"
    ):
        ModelConfig.from_hf(hf)
    with pytest.raises(UnknownFamily, match="model_family: 'llama' dense is not supported"):
        dataclasses.replace(preset("qwen3-tiny"), model_family="llama")


def test_build_model_builds_the_family_on_meta() -> None:
    with torch.device("meta"):
        model = build_model(preset("qwen3-moe-tiny"))
    assert any(".mlp.experts." in name for name, _ in model.named_parameters())
    assert all(p.is_meta for p in model.parameters())


def test_the_planner_reads_the_family_anatomy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family without q/k norms and with a two-matrix MLP is planned with its own coefficients, not Qwen3's."""
    plain = families.Family(
        name="plain", base="plain", hf_model_type="plain", hf_architecture="PlainForCausalLM", key_map="plain",
        moe=False, qk_norm=False, gated_mlp=False,
    )  # fmt: skip
    monkeypatch.setitem(FAMILIES, "plain", plain)
    qwen = preset("qwen3-tiny")
    other = dataclasses.replace(qwen, model_family="plain")
    h, f = qwen.hidden_size, qwen.ffn_hidden_size
    assert layer_params(qwen, 1) - layer_params(other, 1) == h * f  # the gate matrix
    assert qwen.num_params() - other.num_params() == qwen.num_layers * h * f
    lay, tokens = Layout(device_type="cuda"), 16
    a, g, d, e = qwen.num_attention_heads, qwen.num_query_groups, qwen.kv_channels, lay.compute_bytes
    qk = e * a * d + 4 * a + e * g * d + 4 * g  # the q and k norms' inputs and rstd
    gate = e * f  # fc1's second output
    assert layer_activation_bytes(qwen, lay, tokens) - layer_activation_bytes(other, lay, tokens) == tokens * (
        qk + gate
    )
