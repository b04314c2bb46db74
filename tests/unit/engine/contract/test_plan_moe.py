"""The planner on Qwen3-MoE shapes: every expert and the router counted in a rank's weights, the active ones in
FLOPs, MoE flags and checkpoints read without torch, LoRA adapters per expert, 235B-A22B refused on small devices."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from engine.contract.model_config import PRESETS, preset
from engine.contract.plan import DoesNotFit, check_fits, plan_spec
from engine.contract.plan.memory import layer_params
from engine.contract.plan.shape import config_from_checkpoint
from engine.contract.spec import parse_spec

# Qwen/Qwen3-235B-A22B config.json as Megatron flags
QWEN3_235B = {
    "num_layers": 94,
    "hidden_size": 4096,
    "ffn_hidden_size": 12288,
    "num_attention_heads": 64,
    "group_query_attention": True,
    "num_query_groups": 4,
    "kv_channels": 128,
    "padded_vocab_size": 151936,
    "untie_embeddings_and_output_weights": True,
    "num_experts": 128,
    "moe_router_topk": 8,
    "moe_ffn_hidden_size": 1536,
    "norm_topk_prob": True,
    "moe_aux_loss_coeff": 0.001,
}


def moe_spec(**extra: Any) -> dict[str, Any]:
    return {
        "kind": "train",
        "data_path": ["d"],
        "train_iters": 1,
        "lr": 1e-6,
        "bf16": True,
        "seq_length": 4096,
        "micro_batch_size": 1,
        "use_distributed_optimizer": True,
        "resources": {"device_type": "npu", "nproc_per_node": 8},
        **QWEN3_235B,
        **extra,
    }


def test_published_moe_sizes() -> None:
    """Qwen3-30B-A3B: 30.5B total, 3.3B active; Qwen3-235B-A22B: 235B total, 22B active (their model cards)."""
    small, big = preset("qwen3-30b-a3b"), preset("qwen3-235b-a22b")
    assert small.num_params() == pytest.approx(30.5e9, rel=0.01) and small.num_params(active=True) == pytest.approx(
        3.3e9, rel=0.03
    )
    assert big.num_params() == pytest.approx(235e9, rel=0.01) and big.num_params(active=True) == pytest.approx(
        22e9, rel=0.02
    )
    assert {"qwen3-30b-a3b", "qwen3-235b-a22b"} <= PRESETS.keys()


def test_flags_give_the_moe_shape_and_every_expert_is_held() -> None:
    plan = plan_spec(parse_spec(moe_spec()))
    cfg = plan.cfg
    # the spec's flags as the trainer reads them (norm epsilon and RoPE base from the flags: no memory effect)
    assert cfg == preset("qwen3-235b-a22b").replace(
        max_position_embeddings=cfg.max_position_embeddings,
        init_method_std=cfg.init_method_std,
        norm_epsilon=cfg.norm_epsilon,
        rotary_base=cfg.rotary_base,
    )
    # DP 8, TP 1, PP 1: every rank holds the whole model's parameters (FSDP shards the fp32 state over DP)
    assert plan.ranks[0].num_params == cfg.num_params()
    assert plan.ranks[0].main_params == cfg.num_params() * 4 // 8
    assert layer_params(cfg, 1, 0) > 128 * 3 * 4096 * 1536  # all experts of a layer
    body = plan.as_json()
    assert body["num_params"] == cfg.num_params() and body["active_params"] == cfg.num_params(active=True)


def test_moe_lora_adapts_every_expert() -> None:
    full = plan_spec(parse_spec(moe_spec())).ranks[0]
    lora = plan_spec(parse_spec(moe_spec(lora_r=8, lora_alpha=16))).ranks[0]
    h, f, e = 4096, 1536, 128
    per_layer = 8 * ((h + (64 + 8) * 128) + (64 * 128 + h) + e * (h + 2 * f) + e * (f + h))
    assert lora.trainable_params == 94 * per_layer
    assert lora.num_params == full.num_params + lora.trainable_params


def test_moe_activations_count_the_routed_rows() -> None:
    dense = plan_spec(parse_spec(moe_spec(num_experts=None))).ranks[0]
    moe = plan_spec(parse_spec(moe_spec())).ranks[0]
    assert moe.activations > dense.activations  # 8 routed rows of 2×1536 vs one row of 2×12288 per token


def test_235b_on_small_devices_does_not_fit() -> None:
    with pytest.raises(DoesNotFit) as err:
        check_fits(parse_spec(moe_spec()), 64 * 2**30)
    assert err.value.field == "resources" and "weights and optimizer state alone" in str(err.value)
    spread = {"resources": {"device_type": "npu", "nproc_per_node": 8, "nnodes": 64}}
    assert check_fits(parse_spec(moe_spec(**spread, recompute_granularity="full")), 64 * 2**30)


def test_moe_shape_from_checkpoint_config_and_megatron_args(tmp_path: Path) -> None:
    cfg = preset("qwen3-30b-a3b")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    assert config_from_checkpoint(tmp_path) == cfg
    from engine.contract.model_config import moe_from_args

    args = argparse.Namespace(num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, moe_aux_loss_coeff=0.001)
    fields = moe_from_args(args, 48)  # Megatron's own flag names
    assert fields["num_experts"] == 128 and fields["moe_router_topk"] == 8 and fields["moe_ffn_hidden_size"] == 768


def test_moe_experts_divide_by_tp_and_count_per_stage() -> None:
    """TP 2: each rank holds half of every expert (and a whole router); PP 2: each stage counts its own layers'
    experts (the 94 MoE layers split 47 / 47)."""
    cfg = plan_spec(parse_spec(moe_spec())).cfg
    h, f, e = 4096, 1536, 128
    assert (
        layer_params(cfg, 1, 0) - layer_params(cfg, 2, 0)
        == e * 3 * h * f // 2 + (h * (64 + 8) * 128 + 64 * 128 * h) // 2
    )
    tp2 = plan_spec(parse_spec(moe_spec(tensor_model_parallel_size=2))).ranks[0]
    tp1 = plan_spec(parse_spec(moe_spec())).ranks[0]
    assert tp2.num_params < 0.51 * tp1.num_params
    pp2 = plan_spec(parse_spec(moe_spec(pipeline_model_parallel_size=2))).ranks
    stage_params = {r.num_params for r in pp2}
    assert len(stage_params) == 2  # embedding on the first stage, head on the last
    expected = sum(layer_params(cfg, 1, i) for i in range(47)) + 151936 * h
    assert min(stage_params) == expected


def test_expert_parallel_gathers_only_the_ranks_experts() -> None:
    """EP 8 on 8 ranks: the sharded state is the same as EP 1 (experts shard over EP then DP / EP); what FSDP
    gathers for compute holds 128 / 8 experts per layer, so the peak drops (ZeRO-2 keeps every layer gathered)."""
    one = plan_spec(parse_spec(moe_spec(use_distributed_optimizer=False)))
    ep8 = plan_spec(parse_spec(moe_spec(use_distributed_optimizer=False, expert_model_parallel_size=8)))
    a, b = one.peak, ep8.peak
    assert (a.main_params, a.grads, a.optimizer) == (b.main_params, b.grads, b.optimizer)
    cfg = preset("qwen3-235b-a22b")
    experts = cfg.num_layers * 128 * 3 * 4096 * 1536
    assert a.params - b.params == experts * 7 // 8 * 2  # bf16 copies of the experts on the other 7 EP ranks
    assert layer_params(cfg, 1, 0, ep=8) == layer_params(cfg, 1, 0) - 128 * 3 * 4096 * 1536 * 7 // 8
    assert b.total_bytes < a.total_bytes
