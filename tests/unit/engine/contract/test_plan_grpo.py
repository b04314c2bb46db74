"""Stage grpo in the memory planner: the rollout's KV cache (every completion of a rank's groups, prompt +
max_completion_length positions, as ``engine.model.kv_cache.KVCache`` allocates it) and the frozen reference when
beta != 0 are counted, and a job whose generation does not fit is refused at submission naming its field."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from core.db import session_scope
from core.models import Host
from core.settings import Settings
from core_support import auth, isolated_settings, team_dir
from engine.contract.plan import DoesNotFit, check_fits, plan_spec
from engine.contract.plan.memory import generation_bytes, kv_cache_bytes
from engine.contract.spec import TrainSpec, parse_spec
from engine.model.kv_cache import KVCache
from train_support import QWEN3_4B, TINY_SHAPE


def grpo(shape: dict[str, Any] = QWEN3_4B, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "train",
        "data_path": ["d"],
        "train_iters": 10,
        "lr": 1e-6,
        "seq_length": 1024,
        "micro_batch_size": 4,
        "global_batch_size": 64,
        "stage": "grpo",
        "num_generations": 8,
        "max_completion_length": 512,
        "reward_funcs": [{"name": "exact_match"}],
        **shape,
        "resources": {"device_type": "npu", "nproc_per_node": 1},
        **extra,
    }


def _spec(**extra: Any) -> TrainSpec:
    spec = parse_spec(grpo(**extra))
    assert isinstance(spec, TrainSpec)
    return spec


def test_the_kv_cache_counted_is_what_the_engine_allocates() -> None:
    plan = plan_spec(_spec(shape=TINY_SHAPE))
    lay, cfg = plan.layout, plan.cfg
    assert lay.generation_rows == 64  # every completion of the step on the one rank
    cache = KVCache(cfg, lay.generation_rows, lay.seq_length, torch.float32)  # decode's: the weights' dtype
    allocated = sum(t.nbytes for t in [*cache.keys.values(), *cache.values.values()])
    gen = dataclasses.replace(lay, micro_batch_size=lay.generation_rows, eval_tokens=lay.seq_length)
    assert kv_cache_bytes(cfg, gen, cfg.num_layers) == allocated
    assert plan.peak.generation == generation_bytes(cfg, lay, cfg.num_layers) > allocated  # plus prefill and logits


def test_generation_scales_with_the_rank_s_groups_and_is_zero_outside_grpo() -> None:
    one = plan_spec(_spec(bf16=True)).peak.generation
    half = plan_spec(_spec(bf16=True, global_batch_size=32)).peak.generation
    assert 1.9 < one / half < 2.1
    sft = {k: v for k, v in grpo(bf16=True).items() if k not in ("num_generations", "max_completion_length")}
    sft.pop("reward_funcs")
    assert plan_spec(parse_spec({**sft, "stage": "sft"})).peak.generation == 0


def test_the_reference_is_counted_when_beta_is_not_zero() -> None:
    assert plan_spec(_spec(bf16=True)).peak.reference == 0
    with_ref = plan_spec(_spec(bf16=True, beta=0.04)).peak
    assert with_ref.reference >= with_ref.num_params * 2  # the frozen copy in bf16
    assert plan_spec(_spec(bf16=True, beta=0.04, lora_r=8)).peak.reference == 0  # adapters off: no copy


def test_a_generation_that_does_not_fit_names_global_batch_size() -> None:
    spec = _spec(bf16=True)
    peak = plan_spec(spec).peak
    training = peak.persistent_bytes + max(peak.activations + peak.loss + peak.comm, peak.optimizer_step)
    assert peak.generation > peak.activations + peak.loss + peak.comm  # 64 rows × 1,024 positions × 36 layers
    with pytest.raises(DoesNotFit) as err:
        check_fits(spec, training + 2**30)  # training alone would fit
    assert err.value.field == "global_batch_size" and "generation" in str(err.value), str(err.value)
    check_fits(_spec(bf16=True, global_batch_size=8), training + 2**30)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = isolated_settings(tmp_path)
    for suffix in (".bin", ".idx"):  # the data_path prefix "d" exists (admission checks inputs before the planner)
        (team_dir(settings, "alpha") / f"d{suffix}").write_bytes(b"")
    return settings


def test_submission_refuses_a_grpo_job_whose_generation_does_not_fit(
    client: TestClient, token: str, settings: Settings
) -> None:
    peak = plan_spec(_spec(bf16=True)).peak
    room = peak.persistent_bytes + max(peak.activations + peak.loss + peak.comm, peak.optimizer_step) + 2**30
    with session_scope(settings.database_url) as session:
        info = {"device_memory_bytes": room}  # training fits, 256 completions' generation does not
        session.add(Host(name="npu1", device_type="npu", devices=8, queue="host.npu1", address="127.0.0.1", info=info))
    response = client.post("/v1/jobs", json=grpo(bf16=True, global_batch_size=256), headers=auth(token))
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "does_not_fit" and response.json()["field"] == "global_batch_size"
    assert client.post("/v1/jobs", json=grpo(bf16=True, global_batch_size=16), headers=auth(token)).status_code == 201


def test_under_pp_each_stage_counts_its_own_layers_cache_and_the_last_the_logits() -> None:
    """Under PP each rank's decode caches its stage's layers (``engine.parallel.pipeline_decode``) and only the last
    stage samples: the stages' caches add up to one process's, the logits are counted once."""
    one = plan_spec(_spec(shape=TINY_SHAPE))
    two = {"device_type": "npu", "nproc_per_node": 2}
    pp = plan_spec(_spec(shape=TINY_SHAPE, pipeline_model_parallel_size=2, resources=two))
    lay, cfg = one.layout, one.cfg
    assert pp.layout.generation_rows == lay.generation_rows  # DP 1 either way: every completion on each stage
    gen = dataclasses.replace(lay, micro_batch_size=lay.generation_rows, eval_tokens=lay.seq_length)
    first, last = pp.ranks
    logits = lay.generation_rows * cfg.vocab_size * 4
    assert len(first.layers) + len(last.layers) == cfg.num_layers
    for rank in (first, last):
        assert rank.generation - kv_cache_bytes(cfg, gen, len(rank.layers)) == (
            one.ranks[0].generation - kv_cache_bytes(cfg, gen, cfg.num_layers) - (0 if rank is last else logits)
        )


def test_under_cp_every_cp_rank_counts_the_whole_rows_generation() -> None:
    """Under CP every CP rank decodes its DP group's rows whole (``engine.parallel.context_parallel.
    whole_sequences``): each counts one process's generation (every row, the full-length KV cache), not a 1/CP share
    of the positions; CP2 × DP2 halves the rows only."""
    one = plan_spec(_spec(shape=TINY_SHAPE))
    cp2 = plan_spec(
        _spec(shape=TINY_SHAPE, context_parallel_size=2, resources={"device_type": "npu", "nproc_per_node": 2})
    )
    assert cp2.layout.generation_rows == one.layout.generation_rows
    assert [r.generation for r in cp2.ranks] == [one.ranks[0].generation] * 2
    four = {"device_type": "npu", "nproc_per_node": 4}
    cp2_dp2 = plan_spec(_spec(shape=TINY_SHAPE, context_parallel_size=2, resources=four))
    assert cp2_dp2.layout.generation_rows == one.layout.generation_rows // 2
    assert cp2_dp2.peak.generation > 0
