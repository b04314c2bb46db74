"""engine.contract.plan.memory's LoRA terms: adapter activations, the backward working set, DP buffers for adapters only,
and the frozen base counted once."""

from __future__ import annotations

import dataclasses

from engine.contract.layout import ParallelDims
from engine.contract.model_config import preset
from engine.contract.plan import Layout, plan_ranks
from engine.contract.plan.memory import (
    LORA_BACKWARD_FFN_COPIES,
    layer_params,
    lora_activation_bytes,
    lora_layer_params,
    stage_activation_bytes,
)

CFG = preset("qwen3-4b")
FULL = Layout(dims=ParallelDims(pp=2), micro_batch_size=2, global_batch_size=8, seq_length=256, compute_bytes=2)
LORA = dataclasses.replace(FULL, lora_r=16)


def test_adapter_activations_are_each_targets_rank_r_rows() -> None:
    tokens = FULL.tokens
    assert lora_activation_bytes(CFG, FULL, tokens) == 0
    assert lora_activation_bytes(CFG, LORA, tokens) == tokens * 4 * 16 * 2  # four targets, r 16, bf16
    extra = stage_activation_bytes(CFG, LORA, 3, tokens) - stage_activation_bytes(CFG, FULL, 3, tokens)
    assert extra == 3 * lora_activation_bytes(CFG, LORA, tokens)
    full_ac = dataclasses.replace(LORA, recompute="full")  # recomputed layers keep their input only
    assert stage_activation_bytes(CFG, full_ac, 3, tokens) == stage_activation_bytes(
        CFG, dataclasses.replace(full_ac, lora_r=None), 3, tokens
    )


def test_lora_backward_working_set_overlaps_the_loss() -> None:
    """Every stage gets the working set, the last one only beyond its loss buffers (gone by then)."""
    full, lora = plan_ranks(CFG, FULL), plan_ranks(CFG, LORA)
    working = LORA_BACKWARD_FFN_COPIES * CFG.ffn_hidden_size * 2 * LORA.tokens
    for f, lo in zip(full, lora, strict=True):
        held = lo.micro_batches_in_flight
        adapters = held * len(lo.layers) * lora_activation_bytes(CFG, LORA, LORA.tokens)
        assert lo.activations - f.activations == adapters + max(0, working - lo.loss)
    assert lora[0].loss == 0 and 0 < lora[-1].loss


def test_frozen_base_counted_once_and_dp_buffers_for_adapters_only() -> None:
    one = plan_ranks(CFG, dataclasses.replace(LORA, dims=ParallelDims()))[0]
    assert one.params == (one.num_params - one.trainable_params) * 2  # one bf16 copy, no gathered one
    dp2 = dataclasses.replace(LORA, dims=ParallelDims(dp=2), global_batch_size=4)
    full_dp2 = dataclasses.replace(dp2, lora_r=None)
    adapters = lora_layer_params(CFG, 1, 16, LORA.lora_targets)
    assert plan_ranks(CFG, dp2)[0].comm == 2 * adapters * 4
    assert plan_ranks(CFG, full_dp2)[0].comm == 2 * layer_params(CFG, 1) * 4
