"""The torch half of each model family (``engine.contract.families`` holds the torch-free half): the module that
builds a family's model from its ``ModelConfig``, on any device, the meta device included.

Every family builds a model with Megatron-Core's local-spec module names (``embedding``, ``decoder.layers.{i}`` with
``self_attention.linear_qkv`` / ``linear_proj`` and ``mlp.linear_fc1`` / ``linear_fc2`` or ``mlp.experts``,
``decoder.final_layernorm``, ``output_layer``), as Megatron-Core's ``GPTModel`` does for every family it runs: the
tensor-parallel plan (``engine.parallel.tensor_parallel``), the pipeline split (``engine.parallel.pipeline_parallel``),
recompute and the checkpoint converters address modules by those names, so a family that keeps them needs nothing
else registered here.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from engine.contract.families import FAMILIES, UnknownFamily
from engine.contract.model_config import ModelConfig
from engine.model.qwen3 import Qwen3Model

BUILDERS: dict[str, Callable[[ModelConfig], nn.Module]] = {
    "qwen3": Qwen3Model,  # dense
    "qwen3_moe": Qwen3Model,  # the same decoder; MoE layers where cfg.is_moe_layer(i)
}


def build_model(cfg: ModelConfig) -> nn.Module:
    """``cfg``'s family's model, built on the current default device (wrap in ``torch.device("meta")`` to
    allocate nothing)."""
    name = cfg.family.name
    if name not in BUILDERS:
        raise UnknownFamily(f"model family {name!r} has no runtime (engine.model.families.BUILDERS); {list(FAMILIES)}")
    return BUILDERS[name](cfg)
