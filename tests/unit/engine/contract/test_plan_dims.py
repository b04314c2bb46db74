"""The planner's layout holds the spec's ``ParallelDims`` (issue 46): rank coordinates are ``ParallelDims.coords``'s,
context parallelism included, and a serve plan speaks of ``max_num_seqs``, never of micro-batches."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine.contract.layout import ParallelDims
from engine.contract.plan import DoesNotFit, check_fits, plan_spec
from engine.contract.plan.cli import table
from engine.contract.spec import parse_spec
from train_support import QWEN3_4B


def train(**extra: Any) -> dict[str, Any]:
    return {
        "kind": "train",
        "data_path": ["d"],
        "train_iters": 1,
        "lr": 1e-6,
        "bf16": True,
        "seq_length": 800,
        "micro_batch_size": 8,
        "pipeline_model_parallel_size": 2,
        "use_distributed_optimizer": True,
        "resources": {"device_type": "npu", "nproc_per_node": 2},
        **QWEN3_4B,
        **extra,
    }


def serve(**extra: Any) -> dict[str, Any]:
    return {
        "kind": "serve",
        "load": "/m",
        "bf16": True,
        "max_num_seqs": 32,
        "max_model_len": 8192,
        "tensor_model_parallel_size": 2,
        "resources": {"device_type": "cuda", "nproc_per_node": 2},
        **QWEN3_4B,
        **extra,
    }


def test_ranks_take_their_coordinates_from_the_specs_dims_context_parallel_included() -> None:
    """TP2 PP2 CP2 on 8 ranks is one DP rank: ranks 4-7 are CP rank 1 (the hand-made formula this replaced,
    rank // (TP × PP), called them DP rank 1)."""
    spec = parse_spec(train(context_parallel_size=2, tensor_model_parallel_size=2, resources={"nproc_per_node": 8}))
    plan = plan_spec(spec)
    assert plan.layout.dims == spec.parallel_dims
    coords = [spec.parallel_dims.coords(r.rank) for r in plan.ranks]
    assert [(r.tp_rank, r.pp_rank, r.dp_rank, r.cp_rank) for r in plan.ranks] == [
        (c.tp, c.pp, c.dp, c.cp) for c in coords
    ]
    assert {r.dp_rank for r in plan.ranks} == {0} and [r.cp_rank for r in plan.ranks] == [0] * 4 + [1] * 4
    assert [r["cp_rank"] for r in plan.as_json()["ranks"]] == [0] * 4 + [1] * 4
    head, first = table(plan).splitlines()[1:3]
    assert head.split()[:5] == ["rank", "tp", "pp", "dp", "cp"] and first.split()[:5] == ["0"] * 5


def test_without_context_parallelism_the_ranks_json_and_table_keep_their_columns() -> None:
    plan = plan_spec(parse_spec(train(resources={"nproc_per_node": 4})))
    assert [(r.dp_rank, r.pp_rank) for r in plan.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "cp_rank" not in plan.as_json()["ranks"][0]
    assert table(plan).splitlines()[1].split()[:5] == ["rank", "tp", "pp", "dp", "layers"]


def test_a_hybrid_spec_without_context_parallelism_plans_as_one_without_it() -> None:
    """``ulysses_degree_in_cp`` has nothing to split at CP 1: no Ulysses, no ring (the dims once said ring 0)."""
    dims = ParallelDims(cp_algo="hybrid_cp_algo", ulysses_degree_in_cp=2)
    assert (dims.ulysses_degree, dims.ring_degree) == (1, 1)
    hybrid = plan_spec(parse_spec(train(context_parallel_algo="hybrid_cp_algo", ulysses_degree_in_cp=2)))
    plain = plan_spec(parse_spec(train()))
    assert [r.as_json() for r in hybrid.ranks] == [r.as_json() for r in plain.ranks]


def test_a_serve_plan_says_max_num_seqs() -> None:
    spec = parse_spec(serve())
    plan = plan_spec(spec)
    assert plan.layout.max_num_seqs == 32 and plan.layout.rows == 32
    layout = plan.as_json()["layout"]
    assert layout["max_num_seqs"] == 32 and "micro_batch_size" not in layout and "micro_batches" not in layout
    header = table(plan).splitlines()[0]
    assert "max_num_seqs 32" in header and "MBS" not in header
    # the same figures as an eval-shaped layout with 32 rows: the name changed, not the sum
    as_rows = dataclasses.replace(plan.layout, max_num_seqs=None, micro_batch_size=32)
    assert as_rows.rows == plan.layout.rows and as_rows.tokens == plan.layout.tokens


def test_a_serve_job_whose_cache_overflows_is_refused_naming_max_num_seqs() -> None:
    """Beyond the weights, a serve rank's memory is its cache and one step's rows: the refusal names the serve
    field (it named micro_batch_size, a training field a serve spec refuses, before the planner knew max_num_seqs)."""
    spec = parse_spec(serve())
    worst = plan_spec(spec).peak
    device = (worst.persistent_bytes + worst.total_bytes) // 2
    with pytest.raises(DoesNotFit) as err:
        check_fits(spec, device)
    assert err.value.field == "max_num_seqs"
    assert "max_num_seqs 32" in str(err.value) and "micro_batch_size" not in str(err.value)
