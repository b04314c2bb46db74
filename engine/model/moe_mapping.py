"""HF Qwen3-MoE <-> native names of the MoE tensors: the rules live in ``engine.model.hf_mapping`` (the one key
map, ``moe_layer_map``); this module keeps the per-layer helpers the MoE tests and bench use.

    decoder.layers.{i}.mlp.router.weight              (E, H)       <- model.layers.{i}.mlp.gate.weight
    decoder.layers.{i}.mlp.experts.linear_fc1.weight  (E, 2F, H)   <- stack_e [experts.{e}.gate_proj; .up_proj]
    decoder.layers.{i}.mlp.experts.linear_fc2.weight  (E, H, F)    <- stack_e experts.{e}.down_proj

Names are the published checkpoints' (``transformers`` writes them on disk although its in-memory module holds
fused ``experts.gate_up_proj`` / ``experts.down_proj``). Dense layers of an MoE model (``mlp_only_layers``) keep the
dense rules.
"""

from __future__ import annotations

from engine.model.hf_mapping import EXPERT_FC1, EXPERT_FC2, ROUTER, expert_hf, hf_from_native, native_from_hf

__all__ = [
    "EXPERT_FC1",
    "EXPERT_FC2",
    "ROUTER",
    "hf_expert_keys",
    "hf_from_native",
    "moe_native_keys",
    "native_from_hf",
]


def hf_expert_keys(layer: int, expert: int) -> tuple[str, str, str]:
    """HF (gate_proj, up_proj, down_proj) weight names of one expert."""
    p = f"model.layers.{layer}."
    return p + expert_hf(expert, "gate_proj"), p + expert_hf(expert, "up_proj"), p + expert_hf(expert, "down_proj")


def moe_native_keys(layer: int) -> list[str]:
    p = f"decoder.layers.{layer}."
    return [p + ROUTER, p + EXPERT_FC1, p + EXPERT_FC2]
