"""Stage grpo's spec: TRL's names and defaults, and every bad combination refused at submission naming its field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from engine.contract.spec import TrainSpec, first_error, parse_spec

BASE: dict[str, Any] = {
    "kind": "train",
    "data_path": ["d"],
    "train_iters": 2,
    "lr": 1e-3,
    "seq_length": 64,
    "stage": "grpo",
    "micro_batch_size": 4,
    "global_batch_size": 16,
    "reward_funcs": [{"name": "exact_match"}],
}


def test_defaults_are_trls() -> None:
    spec = parse_spec({**BASE, "global_batch_size": 16})
    assert isinstance(spec, TrainSpec)
    assert (spec.num_generations, spec.beta, spec.epsilon, spec.epsilon_high) == (8, 0.0, 0.2, None)
    assert (spec.num_iterations, spec.max_completion_length, spec.temperature, spec.top_p) == (1, 512, 1.0, 1.0)
    assert (spec.loss_type, spec.scale_rewards, spec.advantage_eps) == ("dapo", "group", 1e-4)
    assert not spec.kl_clamp and not spec.mask_truncated_completions and spec.top_k is None
    assert parse_spec({**BASE, "scale_rewards": False}).scale_rewards == "none"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"num_generations": 3}, "global_batch_size"),
        ({"reward_funcs": []}, "reward_funcs"),
        ({"reward_funcs": [{"name": "regex"}]}, "pattern"),
        ({"reward_funcs": [{"name": "regex", "pattern": "(a"}]}, "pattern"),
        ({"reward_funcs": [{"name": "json_schema", "json_schema": {"type": "nope"}}]}, "json_schema"),
        ({"reward_funcs": [{"name": "exact_match", "pattern": "a"}]}, "pattern"),
        ({"reward_funcs": [{"name": "exact_match"}, {"name": "exact_match"}]}, "reward_funcs"),
        ({"reward_weights": [1.0, 2.0]}, "reward_weights"),
        ({"ref_model": "r"}, "ref_model"),
        ({"kl_clamp": True}, "kl_clamp"),
        ({"beta": 0.1, "ref_model": "r", "lora_r": 4}, "ref_model"),
        ({"num_iterations": 2, "save_interval": 3}, "save_interval"),
        ({"loss_type": "sigmoid"}, "loss_type"),
        ({"tensor_model_parallel_size": 2}, "tensor_model_parallel_size"),
        ({"stage": "sft", "num_generations": 4}, "num_generations"),
        ({"stage": "sft", "reward_funcs": [{"name": "format"}]}, "reward_funcs"),
    ],
)
def test_bad_grpo_specs_name_their_field(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({**BASE, **extra})
    assert first_error(err.value, "spec").split(":")[0].split(".")[-1] == field, first_error(err.value, "spec")


def test_sft_and_dpo_specs_are_unchanged() -> None:
    sft = {k: v for k, v in BASE.items() if k != "reward_funcs"}
    spec = parse_spec({**sft, "stage": "sft"})
    assert spec.stage == "sft"  # type: ignore[attr-defined]
    with pytest.raises(ValidationError):
        parse_spec({**sft, "stage": "sft", "ref_model": "r"})  # still dpo's only


# layouts: DP, TP, PP, EP and CP run (equal to one process: tests/integration/test_train_grpo_parallel.py) when the step's
# prompts split over the DP ranks (each rank samples whole groups); what does not run yet is refused by name
LAYOUT_BASE = {**BASE, "micro_batch_size": 2, "num_generations": 4}
TWO = {"resources": {"nproc_per_node": 2}}
MOE = {"num_experts": 4, "moe_router_topk": 2}


@pytest.mark.parametrize(
    "extra",
    [
        {"resources": {"nproc_per_node": 2}},
        {"resources": {"nproc_per_node": 4}},
        {"resources": {"nproc_per_node": 2}, "tensor_model_parallel_size": 2, "sequence_parallel": True},
        {"resources": {"nproc_per_node": 2}, "expert_model_parallel_size": 2, **MOE},
        {"resources": {"nproc_per_node": 2}, "pipeline_model_parallel_size": 2},
        # PP2 × TP2 × DP2 (without sequence parallelism)
        {"resources": {"nproc_per_node": 8}, "pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2},
        # TP2 × DP4: the 4 prompts split over the 4 DP ranks
        {"resources": {"nproc_per_node": 8}, "tensor_model_parallel_size": 2, "micro_batch_size": 1},
        # CP2, and CP2 × DP2: the CP ranks of a DP group decode its groups together (CP is no DP split)
        {"resources": {"nproc_per_node": 2}, "context_parallel_size": 2},
        {"resources": {"nproc_per_node": 4}, "context_parallel_size": 2, "micro_batch_size": 1},
    ],
)
def test_data_and_tensor_parallel_are_accepted_when_the_prompts_split(extra: dict[str, Any]) -> None:
    spec = parse_spec({**LAYOUT_BASE, **extra})
    assert isinstance(spec, TrainSpec) and spec.resources.world_size == extra["resources"]["nproc_per_node"]


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        # 16 completions / 4 per prompt = 4 prompts over 8 ranks: a group would straddle two ranks
        ({"resources": {"nproc_per_node": 8}, "micro_batch_size": 1}, "global_batch_size", "do not split over DP 8"),
        (
            {"resources": {"nproc_per_node": 16}, "tensor_model_parallel_size": 2, "micro_batch_size": 1},
            "global_batch_size",
            "do not split over DP 8",
        ),
        (
            {
                "resources": {"nproc_per_node": 4},
                "pipeline_model_parallel_size": 2,
                "tensor_model_parallel_size": 2,
                "sequence_parallel": True,
            },
            "sequence_parallel",
            "not sequence shards",
        ),
        (
            {"resources": {"nproc_per_node": 4}, "context_parallel_size": 2, "pipeline_model_parallel_size": 2},
            "context_parallel_size",
            "takes no CP shards",
        ),
        # CP2 × DP4: 4 prompts over 4 DP ranks split; over DP 8 (CP2 × DP8 of 16 ranks) they do not
        (
            {"resources": {"nproc_per_node": 16}, "context_parallel_size": 2, "micro_batch_size": 1},
            "global_batch_size",
            "do not split over DP 8",
        ),
    ],
)
def test_layouts_not_run_yet_are_refused_by_name(extra: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({**LAYOUT_BASE, **extra})
    message = first_error(err.value, "spec")
    assert message.split(":")[0].split(".")[-1] == field, message
    assert words in message, message
