"""Stage grpo on two ranks (torchrun, gloo) equals one process, and a DP2 run resumes bit-identically.

Under data parallel (FSDP2) each rank samples its share of the prompts' groups with the groups' own generators; under
tensor parallel (with or without SP) both ranks decode every row on their shards; under pipeline parallel each
token's forward passes stage to stage and the last stage's sampled tokens go back to the first; under expert parallel
(Qwen3-MoE) the ranks' decoding meets in the all-to-all; under context parallelism both CP ranks decode every row
whole and train on their shares of each row. Either way the completions the run writes are the very token ids one
process writes (asserted, not fed), and on them the steps' loss, grad norm, rewards and advantages equal the
one-process run's, for loss types whose denominators span the whole batch (dapo: its tokens, grpo: its sequences)
and batch-scaled advantages (the ranks' rewards gathered)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_support import tiny_qwen3, write_prompts
from train_support import metric_rows, run_train

# up to three engine runs per test (a case's first test runs its one-process side too, the resume test the DP2 grpo
# run unless a test before it in this process did): ~90 s on a quiet host, past 300 s under a load average of 70
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REWARDS = [
    {"name": "regex", "pattern": "[aeiou]", "strip_thinking": False},
    {"name": "regex", "label": "even", "pattern": r"^(..)*$", "strip_thinking": False},
]
CASES = {
    # one rollout, two steps on it (the ratio moves off 1), a reference, batch-scaled advantages, dapo's token count
    "dapo_batch_beta_mu2": {"loss_type": "dapo", "scale_rewards": "batch", "beta": 0.04, "num_iterations": 2},
    # two rollouts (the second from updated weights), per-sequence means, group advantages, a reference (the DP2 run
    # is also the resume test's uninterrupted run)
    "grpo_group_two_rollouts": {"loss_type": "grpo", "scale_rewards": "group", "beta": 0.04},
}


# Adam's first step moves every weight by lr times the sign of its gradient, also where that gradient is rounding noise
# (its sign then depends on the layout's reduction order). At 3e-2 that put step 2's grad norm 4e-5 off one process
# under TP2 (the run's completions and step 1 identical); the error scales with lr, and 1e-3 still moves every weight
# by 5% of its init scale, so the second rollout's tokens come from visibly updated weights.
LR = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_dir: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("grpo-parallel")
    torch.manual_seed(0)
    tiny_qwen3().save_pretrained(root / "policy")
    tiny_qwen3(moe=True).save_pretrained(root / "policy_moe")
    write_prompts(root / "data", qwen_tokenizer_dir)
    return {"root": root, "tokenizer": str(qwen_tokenizer_dir)}


def _spec(setup: dict[str, Any], moe: bool, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "train", "stage": "grpo", "data_path": [str(setup["root"] / "data")],
        "load": str(setup["root"] / ("policy_moe" if moe else "policy")), "tokenizer_name_or_path": setup["tokenizer"], "split": "100,0,0",
        "seq_length": 128, "micro_batch_size": 4, "global_batch_size": 8, "num_generations": 4,
        "max_completion_length": 8, "temperature": 0.9, "train_iters": 2, "lr": LR, "lr_decay_style": "constant",
        "weight_decay": 0.0, "clip_grad": 1.0, "log_interval": 1, "seed": 3, "reward_funcs": REWARDS,
        "variable_seq_lengths": True, **extra,
    }  # fmt: skip


def _completions(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]


LAYOUTS = {
    "dp2": {},
    # generation on the TP-sharded policy: each rank caches its KV heads, the head's logits are all-gathered
    "tp2": {"tensor_model_parallel_size": 2},
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    # a Qwen3-MoE's experts split over the two DP ranks: each rank's decode and training tokens reach every expert
    # through the all-to-all (the ranks step together), the aux loss weighted per routed token as in SFT
    "ep2": {"expert_model_parallel_size": 2},
    # a layer per stage: decoding passes hidden states stage to stage (each stage's KV cache its own layer's), the loss
    # and the old-policy and reference passes on the last stage through the schedule (the reference its own pipeline)
    "pp2": {"pipeline_model_parallel_size": 2},
    # both CP ranks decode every row whole (CP's attention set aside); the loss, old-policy and reference passes on
    # each rank's head/tail chunks of every row, grpo's per-sequence token means from the CP ranks' partial sums.
    # Padded rows: packed, a micro-batch's four equal-length rows fall on the ring's four chunks whole, and no
    # completion would be split over the two ranks
    "cp2": {"context_parallel_size": 2, "context_parallel_algo": "megatron_cp_algo", "padding_free": False},
    # LoRA (both sides): the reference of beta > 0 is the base with the adapters off, under TP too
    "lora_tp2": {"tensor_model_parallel_size": 2, "lora_r": 4, "lora_target_modules": ["linear_qkv", "linear_fc1"]},
}
# One case per layout where one covers what the layout changes, both where the batch is split over the ranks:
# DP2 splits it (each case's denominators and gathered rewards span the ranks); TP2 decodes the second rollout on
# updated shards; SP's sequence-sharded training, forward and reference; EP2 (a DP split too) its all-to-all in decode,
# training and the reference forward with dapo's batch-wide token count; LoRA's reference with the adapters off; PP2
# its staged decoding, and the schedule's loss, old-policy (mu 2) and frozen-reference passes; CP2 its whole-row
# decoding on both ranks (the second rollout from updated weights) and grpo's per-sequence means over split rows.
MATRIX = [
    ("dapo_batch_beta_mu2", "dp2"),
    ("grpo_group_two_rollouts", "dp2"),
    ("grpo_group_two_rollouts", "tp2"),
    ("dapo_batch_beta_mu2", "tp2_sp"),
    ("dapo_batch_beta_mu2", "ep2"),
    ("dapo_batch_beta_mu2", "lora_tp2"),
    ("dapo_batch_beta_mu2", "pp2"),
    ("grpo_group_two_rollouts", "cp2"),
]
BOTH_SIDES = ("lora_r", "lora_target_modules")  # a layout's keys the one-process run takes too
_RUNS: dict[str, Path] = {}


def _run(spec: dict[str, Any], run_dir: Path, nproc: int) -> Path:
    """The run of ``spec`` on ``nproc`` processes, once per test process (the one-process side of a case serves every
    layout, and the DP2 grpo run the resume test as well)."""
    key = json.dumps([spec, nproc], sort_keys=True)
    if key not in _RUNS:
        run_train(spec, run_dir, nproc)
        _RUNS[key] = run_dir
    return _RUNS[key]


def _specs(setup: dict[str, Any], case: str, layout: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(one process, two ranks) specs of ``case`` under ``layout``."""
    both = {k: v for k, v in LAYOUTS[layout].items() if k in BOTH_SIDES}
    one = _spec(setup, "expert_model_parallel_size" in LAYOUTS[layout], **CASES[case], **both)
    return one, {**one, **LAYOUTS[layout], "resources": {"nproc_per_node": 2}}


@pytest.mark.parametrize(("case", "layout"), MATRIX, ids=[f"{c}-{lay}" for c, lay in MATRIX])
def test_grpo_on_two_ranks_equals_one_process(setup: dict[str, Any], tmp_path: Path, case: str, layout: str) -> None:
    one_spec, two_spec = _specs(setup, case, layout)
    one_dir, two_dir = _run(one_spec, tmp_path / "one", 1), _run(two_spec, tmp_path / "two", 2)
    one, two = _completions(one_dir), _completions(two_dir)
    assert len(one) == len(two) == 8 * (2 // one_spec.get("num_iterations", 1))
    for a, b in zip(one, two, strict=True):
        assert (a["iteration"], a["prompt_id"], a["completion_ids"]) == (
            b["iteration"],
            b["prompt_id"],
            b["completion_ids"],
        )
        assert b["reward"] == a["reward"]
        assert b["advantage"] == pytest.approx(a["advantage"], rel=1e-6, abs=1e-7)
    assert len({tuple(r["completion_ids"]) for r in one}) > 1  # sampled, not one repeated completion
    rows_one, rows_two = metric_rows(one_dir), metric_rows(two_dir)
    assert len(rows_one) == len(rows_two) == 2
    for a, b in zip(rows_one, rows_two, strict=True):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5, abs=1e-7), "lm_loss"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), "grad_norm"
        for key in ("reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean", "completions/mean_length"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert a["grad_norm"] > 0
    parallel = json.loads((two_dir / "result.json").read_text())["summary"]["parallel"]
    tp, pp, ep = (LAYOUTS[layout].get(f"{k}_model_parallel_size", 1) for k in ("tensor", "pipeline", "expert"))
    cp = LAYOUTS[layout].get("context_parallel_size", 1)
    assert parallel == {"dp": 2 // (tp * pp * cp), "tp": tp, "pp": pp, "ep": ep, "cp": cp}


def test_a_dp2_run_resumed_from_its_checkpoint_continues_bit_identically(setup: dict[str, Any], tmp_path: Path) -> None:
    """Each group's sampler is a function of (seed, rollout, prompt), so a DP2 run stopped after its first rollout and
    resumed from that checkpoint samples and trains exactly as the run that never stopped (the reference that of the
    run's start: beta > 0)."""
    _, whole_spec = _specs(setup, "grpo_group_two_rollouts", "dp2")
    whole = _run(whole_spec, tmp_path / "whole", 2)
    part = {**whole_spec, "save": str(tmp_path / "b"), "save_interval": 1}
    run_train({**part, "train_iters": 1}, tmp_path / "part", 2)
    run_train(part, tmp_path / "part", 2)
    assert _completions(tmp_path / "part") == _completions(whole)
    ours, theirs = metric_rows(whole), metric_rows(tmp_path / "part")
    assert [r["iteration"] for r in theirs] == [1, 2]
    assert ours[1]["kl"] > 0  # the reference differs from the policy after step 1
    for a, b in zip(ours, theirs, strict=True):
        assert (a["lm_loss"], a["grad_norm"], a["reward"], a["kl"]) == (
            b["lm_loss"],
            b["grad_norm"],
            b["reward"],
            b["kl"],
        )
