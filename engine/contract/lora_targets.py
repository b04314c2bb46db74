"""The modules LoRA may wrap, by Megatron or HF name, without torch: the API checks ``lora_target_modules`` at
submission (``engine.contract.spec``) and the API process never imports torch, so the table is written out here rather than
derived from ``hf_mapping`` (which needs torch); ``tests/unit/engine/model/test_lora.py`` holds it equal to that key map."""

from __future__ import annotations

from collections.abc import Iterable

MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
HF_TO_MEGATRON = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")  # fused from several HF matrices; B sharded on dim 0 under TP


def resolve_targets(targets: Iterable[str]) -> list[str]:
    """Megatron module names for Megatron or HF ``targets`` (all four when none); ValueError for unknown names and
    for part of a fused module."""
    names = [t.strip() for t in targets if t.strip()]
    if not names:
        return list(MEGATRON_TARGETS)
    unknown = [t for t in names if t not in MEGATRON_TARGETS and t not in HF_TO_MEGATRON]
    if unknown:
        raise ValueError(
            f"lora_target_modules: unknown {unknown}; use {' '.join(MEGATRON_TARGETS)} or {' '.join(HF_TO_MEGATRON)}"
        )
    chosen = {HF_TO_MEGATRON.get(t, t) for t in names}
    for fused in COLUMN_PARALLEL:
        parts = {hf for hf, m in HF_TO_MEGATRON.items() if m == fused}
        given = parts & set(names)
        if given and given != parts and fused not in names:
            raise ValueError(
                f"lora_target_modules: {sorted(given)} is only part of the fused {fused} ({'+'.join(sorted(parts))}); "
                f"LoRA adapts the fused matrix as a whole: give all of {sorted(parts)} or {fused}"
            )
    return [t for t in MEGATRON_TARGETS if t in chosen]
