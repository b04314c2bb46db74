"""MoE flags in job specs and on the command line, and the ModelConfig fields they give."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.contract.flags import spec_from_argv
from engine.contract.model_config import ModelConfig, moe_fields_from_flags, preset
from engine.contract.spec import parse_spec

BASE = ["--data-path", "/d/x", "--train-iters", "2", "--lr", "1e-5"]
MINDSPEED_MOE = [
    "--num-experts",
    "128",
    "--moe-router-topk",
    "8",
    "--moe-ffn-hidden-size",
    "768",
    "--moe-grouped-gemm",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--expert-model-parallel-size",
    "1",
    "--moe-layer-freq",
    "1",
    "--moe-router-load-balancing-type",
    "aux_loss",
    "--moe-aux-loss-coeff",
    "0.001",
    "--norm-topk-prob",
    "--moe-expert-capacity-factor",
    "1.25",
    "--moe-permutation-async-comm",
]


def _train(**fields: object) -> dict:
    return {"kind": "train", "data_path": "/d/x", "train_iters": 2, "lr": 1e-5, **fields}


def test_megatron_moe_flags_parse_into_the_spec() -> None:
    spec, _, ignored = spec_from_argv("train", BASE + MINDSPEED_MOE)
    assert (spec.num_experts, spec.moe_router_topk, spec.moe_ffn_hidden_size) == (128, 8, 768)
    assert spec.moe_grouped_gemm and spec.norm_topk_prob and spec.moe_token_dispatcher_type == "alltoall"
    assert (spec.moe_aux_loss_coeff, spec.moe_expert_capacity_factor, spec.moe_layer_freq) == (0.001, 1.25, 1)
    assert ignored == ["--moe-permutation-async-comm"]


def test_expert_parallelism_composes_with_tp_and_pp() -> None:
    """EP2 alone, with TP2, with PP2 and with both parse (in a spec and on the command line); EP must still divide
    the data-parallel size, naming the field."""
    four = {"resources": {"nproc_per_node": 4}}
    for layout in ({}, {"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2, "num_layers": 2}):
        spec = parse_spec(_train(num_experts=8, expert_model_parallel_size=2, **layout, **four))
        assert spec.expert_model_parallel_size == 2
    both = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "num_layers": 2}
    spec = parse_spec(_train(num_experts=8, expert_model_parallel_size=2, **both, resources={"nproc_per_node": 8}))
    assert (spec.expert_model_parallel_size, spec.tensor_model_parallel_size) == (2, 2)
    argv = ["--num-experts", "8", "--expert-model-parallel-size", "2", "--num-layers", "2"]
    tp_pp = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert spec_from_argv("train", BASE + argv + tp_pp + ["--nproc-per-node", "8"])[0].pipeline_model_parallel_size == 2
    with pytest.raises(ValidationError, match="expert_model_parallel_size: EP 2 must divide the data-parallel size 1"):
        spec_from_argv("train", BASE + argv + tp_pp + ["--nproc-per-node", "4"])


@pytest.mark.parametrize(
    ("value", "expected"),
    [("2", 2), ("[1,0,1,1]", [1, 0, 1, 1]), ("1,0,1,1", [1, 0, 1, 1]), ([1, 1, 0, 1], [1, 1, 0, 1])],
)
def test_moe_layer_freq_forms(value: object, expected: object) -> None:
    assert parse_spec(_train(num_layers=4, moe_layer_freq=value)).moe_layer_freq == expected  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"moe_layer_freq": "([1]*3+[0])*2"}, "moe_layer_freq"),
        ({"moe_layer_freq": [1, 2]}, "moe_layer_freq"),
        ({"moe_layer_freq": 0}, "moe_layer_freq"),
        ({"num_layers": 3, "moe_layer_freq": [1, 0]}, "moe_layer_freq: the pattern has 2 entries"),
        ({"num_experts": 4, "moe_router_topk": 8}, "moe_router_topk: 8 is more than num_experts"),
        ({"moe_token_dispatcher_type": "alltoall_seq"}, "moe_token_dispatcher_type"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "moe_router_load_balancing_type"),
        ({"moe_expert_capacity_factor": 0}, "moe_expert_capacity_factor"),
        ({"moe_ffn_hidden_size": 768, "moe_intermediate_size": 512}, "moe_intermediate_size"),
    ],
)
def test_bad_moe_fields_are_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        parse_spec(_train(**fields))


def test_config_from_flags_for_a_new_model() -> None:
    spec = parse_spec(
        _train(
            num_layers=3,
            num_experts=8,
            moe_router_topk=2,
            moe_intermediate_size=32,
            moe_layer_freq="[1,0,1]",
            norm_topk_prob=True,
            moe_aux_loss_coeff=0.01,
        )
    )
    cfg = ModelConfig(3, 64, 128, 4, 2, 16, **moe_fields_from_flags(spec))
    assert cfg.moe_layers == [0, 2] and cfg.expert_ffn_hidden_size == 32 and cfg.norm_topk_prob
    assert cfg.moe_aux_loss_coeff == 0.01 and cfg.moe_expert_capacity_factor is None


def test_config_overrides_for_a_loaded_checkpoint() -> None:
    base = preset("qwen3-30b-a3b")
    keep = moe_fields_from_flags(parse_spec(_train()), base)
    assert base.replace(**keep) == base  # unset flags keep the checkpoint's coefficient (router_aux_loss_coef)
    spec = parse_spec(_train(moe_router_load_balancing_type="none", moe_expert_capacity_factor=2))
    off = moe_fields_from_flags(spec, base)
    assert base.replace(**off).moe_aux_loss_coeff == 0.0 and base.replace(**off).moe_expert_capacity_factor == 2
    assert moe_fields_from_flags(parse_spec(_train()), preset("qwen3-8b")) == {}  # dense stays dense
