"""The ``serve`` job kind's spec, memory plan and admission: weights + the KV cache of max_num_seqs × max_model_len
(the very bytes the engine allocates), kv_cache_memory_fraction refused at submission, one-process layout only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from engine.contract.plan import DoesNotFit, check_fits, plan_spec
from engine.contract.plan.memory import kv_cache_bytes
from engine.contract.spec import ServeSpec, parse_spec
from engine.serve.slots import SlotCache
from train_support import QWEN3_4B


def serve(**extra: Any) -> dict[str, Any]:
    return {"kind": "serve", "load": "/m", "bf16": True, "resources": {"device_type": "npu"}, **QWEN3_4B, **extra}


def test_spec_fields_and_checks() -> None:
    spec = parse_spec(serve(served_model_name="qwen3-4b-sft", max_num_seqs=8, idle_timeout_s=60))
    assert isinstance(spec, ServeSpec) and spec.max_model_len == 2048
    for bad, field in [
        ({"served_model_name": "no spaces"}, "served_model_name"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
        ({"pipeline_model_parallel_size": 2, "resources": {"nproc_per_node": 2}}, "pipeline_model_parallel_size"),
        ({"lora_load": "/a", "lora_adapters": {"x": "/b"}}, "lora_adapters"),
        ({"lora_adapters": {"no spaces": "/b"}}, "lora_adapters"),
        ({"served_model_name": "m", "lora_adapters": {"m": "/b"}}, "lora_adapters"),
    ]:
        with pytest.raises(ValidationError, match=field):
            parse_spec(serve(**bad))


def test_serving_runs_on_one_node_with_every_rank_a_tp_rank() -> None:
    """The one copy of serving's ranks rule is the spec's: the API and the engine both parse the spec."""
    res = {"device_type": "npu", "nproc_per_node": 4}
    assert parse_spec(serve(tensor_model_parallel_size=4, resources=res)).parallel_dims.tp == 4
    for bad, field in [
        ({"tensor_model_parallel_size": 2, "resources": res}, "tensor_model_parallel_size: serving runs on one node"),
        ({"tensor_model_parallel_size": 2, "resources": {**res, "nproc_per_node": 2, "nnodes": 2}}, "nnodes 1"),
        ({"tensor_model_parallel_size": 1, "resources": {**res, "nproc_per_node": 1, "nnodes": 2}}, "got 2 × 1"),
        (
            {"tensor_model_parallel_size": 2, "resources": {**res, "nproc_per_node": 2}, "lora_adapters": {"a": "/b"}},
            "lora_adapters: per-request adapters are served with TP 1",
        ),
    ]:
        with pytest.raises(ValidationError, match=field):
            parse_spec(serve(**bad))


def test_plan_counts_the_kv_cache_the_engine_allocates() -> None:
    small = plan_spec(parse_spec(serve(max_num_seqs=1, max_model_len=1024))).peak
    big = plan_spec(parse_spec(serve(max_num_seqs=16, max_model_len=4096))).peak
    # 16 × 4096 positions × 36 layers × 2 (k, v) × 8 groups × 128 × 2 bytes = 9 GiB more than 1 × 1024
    assert big.params == small.params
    kv = 2 * 36 * 8 * 128 * 2
    assert big.activations - small.activations >= (16 * 4096 - 1024) * kv
    plan = plan_spec(parse_spec(serve(**{**QWEN3_4B, "num_layers": 2}, max_num_seqs=3, max_model_len=40)))
    cache = SlotCache(plan.cfg, 3, 40, torch.bfloat16, device="meta")
    allocated = sum(t.numel() * t.element_size() for t in [*cache.keys.values(), *cache.values.values()])
    assert kv_cache_bytes(plan.cfg, plan.layout, 2) == allocated


def test_kv_cache_memory_fraction_is_refused_naming_max_num_seqs() -> None:
    spec = parse_spec(serve(max_num_seqs=64, max_model_len=8192, kv_cache_memory_fraction=0.5))
    with pytest.raises(DoesNotFit, match="kv_cache_memory_fraction 0.5") as err:
        check_fits(spec, 64 * 2**30)  # ~8 GiB of bf16 weights, 72 GiB of KV cache: over half of what is left
    assert err.value.field == "max_num_seqs"
    check_fits(parse_spec(serve(max_num_seqs=8, max_model_len=8192, kv_cache_memory_fraction=0.5)), 64 * 2**30)
