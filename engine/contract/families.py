"""The model families the engine runs, each a torch-free descriptor the service and the planner read.

A family is what an HF ``config.json`` names in ``model_type``: its shape is read into ``ModelConfig`` (Megatron's
names), its layer anatomy sets the memory planner's coefficients, and ``key_map`` names the native <-> HF tensor map
its checkpoints use. The torch half of a family (the model class, its tensor-parallel plan, its pipeline split) is
registered in ``engine.families``; a family is runnable when both halves exist. Qwen3 dense and Qwen3-MoE are the
two registered here; ``docs/adding-a-model-family.md`` says what a third one touches.

Kept in a plain dict rather than entry points: the families are part of the engine's release, reviewed with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family, by what the service needs to know of it without torch."""

    name: str  # the engine's name: the HF model_type
    base: str  # ModelConfig.model_family: dense and MoE variants of one architecture share it
    hf_model_type: str  # config.json "model_type"
    hf_architecture: str  # config.json "architectures"[0]
    key_map: str  # the native <-> HF tensor map of its checkpoints (engine.model.hf_mapping for Qwen3)
    moe: bool  # routed experts in some layers (num_experts)
    # Layer anatomy, as the memory planner counts it (engine.contract.plan.memory):
    qk_norm: bool = True  # RMSNorm on each head's q and k (saves their input and rstd)
    gated_mlp: bool = True  # SwiGLU: fc1 holds [gate; up], 3 FFN matrices; else 2 (fc1, fc2)
    description: str = ""

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def fc1_widths(self) -> int:
        """How many FFN-wide outputs fc1 gives per token (gate and up for SwiGLU)."""
        return 2 if self.gated_mlp else 1


QWEN3 = Family(
    name="qwen3",
    base="qwen3",
    hf_model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    key_map="qwen3",
    moe=False,
    description="Qwen3 dense (0.6B … 32B): GQA with q/k RMSNorm, SwiGLU, RoPE (optionally YaRN).",
)
QWEN3_MOE = Family(
    name="qwen3_moe",
    base="qwen3",
    hf_model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    key_map="qwen3",
    moe=True,
    description="Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention with routed SwiGLU experts.",
)

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN3, QWEN3_MOE)}


class UnknownFamily(ValueError):
    """A model the engine has no family for; the message names what was given and what is supported."""


def family(name: str) -> Family:
    """The family registered as ``name``; ``UnknownFamily`` otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownFamily(f"model family {name!r} is not supported; supported: {', '.join(FAMILIES)}") from None


def family_for(base: str, moe: bool) -> Family:
    """The family of a model of architecture ``base`` (``ModelConfig.model_family``), dense or MoE."""
    for f in FAMILIES.values():
        if f.base == base and f.moe == moe:
            return f
    kinds = ", ".join(f"{f.base} ({'MoE' if f.moe else 'dense'})" for f in FAMILIES.values())
    raise UnknownFamily(f"model_family: {base!r} {'MoE' if moe else 'dense'} is not supported; supported: {kinds}")


def family_of_hf(hf: dict[str, Any]) -> Family:
    """The family an HF ``config.json`` names. A config without ``model_type`` is read as Qwen3 (dense, or MoE when
    it has experts), as hand-written test configs are; any other ``model_type`` is refused by name."""
    model_type = hf.get("model_type")
    if model_type is None:
        return QWEN3_MOE if hf.get("num_experts") else QWEN3
    for f in FAMILIES.values():
        if f.hf_model_type == model_type:
            return f
    supported = ", ".join(f.hf_model_type for f in FAMILIES.values())
    raise UnknownFamily(f"model_type {model_type!r} is not a supported model family ({supported})")
