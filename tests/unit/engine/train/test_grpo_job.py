"""Stage grpo as a job in one process, exact against an independent computation: on the completion token ids the job
writes (completions.jsonl), a transformers Qwen3 computes TRL's ``GRPOTrainer`` loss (written out here: per-token
log-probs of logits / temperature, the clipped surrogate, the k3 KL to a reference, the ``loss_type``'s
aggregation) and its gradient; the job's step-1 loss and grad norm equal them for every ``loss_type`` ×
``scale_rewards`` × β ∈ {0, 0.04} × μ ∈ {1, 2} (μ = 2: step 2 too, on the same completions after one AdamW step,
where the ratio moves off 1). The advantages the job wrote equal TRL's formula on the rewards it wrote. A run
resumed from its checkpoint continues bit-identically (completions and metrics)."""

from __future__ import annotations

import copy
import itertools
import json
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[3]))
from engine.contract.runfiles import RunDir  # noqa: E402
from engine.contract.spec import TrainSpec, parse_spec  # noqa: E402
from engine.train import entry  # noqa: E402
from grpo_support import tiny_qwen3, write_prompts  # type: ignore[import-not-found]  # noqa: E402
from train_support import metric_rows  # type: ignore[import-not-found]  # noqa: E402

G, GBS, MAX_LEN, TEMPERATURE, LR, BETA = 4, 8, 8, 0.9, 1e-3, 0.04
# rewards that differ among random completions: an ASCII vowel in the text, the text's length parity
REWARDS = [
    {"name": "regex", "pattern": "[aeiou]", "strip_thinking": False},
    {"name": "regex", "label": "even", "pattern": r"^(..)*$", "strip_thinking": False},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_dir: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("grpo")
    torch.manual_seed(0)
    model = tiny_qwen3()
    model.save_pretrained(root / "policy")
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ref.save_pretrained(root / "ref")
    write_prompts(root / "data", qwen_tokenizer_dir)
    return {"root": root, "model": model, "ref": ref, "tokenizer": str(qwen_tokenizer_dir)}


def _spec(setup: dict[str, Any], steps: int, **extra: Any) -> dict[str, Any]:
    root = setup["root"]
    spec = {
        "kind": "train",
        "stage": "grpo",
        "data_path": [str(root / "data")],
        "load": str(root / "policy"),
        "tokenizer_name_or_path": setup["tokenizer"],
        "split": "100,0,0",
        "seq_length": 128,
        "micro_batch_size": GBS,
        "global_batch_size": GBS,
        "num_generations": G,
        "max_completion_length": MAX_LEN,
        "temperature": TEMPERATURE,
        "train_iters": steps,
        "lr": LR,
        "lr_decay_style": "constant",
        "weight_decay": 0.0,
        "clip_grad": 1.0,
        "log_interval": 1,
        "seed": 3,
        "reward_funcs": REWARDS,
        "variable_seq_lengths": True,
        **extra,
    }
    if spec.get("beta"):
        spec["ref_model"] = str(root / "ref")
    return spec


def _run(spec: dict[str, Any], run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    entry.run(cast(TrainSpec, parse_spec(spec)), RunDir(run_dir))
    rows = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    return metric_rows(run_dir), rows


def _trl_advantages(rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """TRL's GRPOTrainer lines (sum_then_normalize), with its own nanstd."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    std = nanstd(rewards).expand_as(rewards) if scale == "batch" else nanstd(rewards.view(-1, G), dim=1)
    std = std if scale == "batch" else std.repeat_interleave(G)
    adv = rewards - mean
    return adv if scale == "none" else adv / (std + 1e-4)


def _logps(model: Any, prompts: list[list[int]], completions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) per-token log-probs of each completion under logits / temperature, and the completion mask."""
    width = max(len(c) for c in completions)
    out = torch.zeros(len(prompts), width, dtype=torch.float32)
    mask = torch.zeros(len(prompts), width)
    rows = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float() / TEMPERATURE
        lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(c)[:, None])[:, 0]
        rows.append(torch.nn.functional.pad(lp, (0, width - len(c))))
        mask[i, : len(c)] = 1
    out = torch.stack(rows)
    return out, mask


def _trl_loss(loss_type: str, logp, old, ref, adv, mask, beta: float) -> torch.Tensor:
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 0.8, 1.2)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if beta:
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * MAX_LEN)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)  # dapo, one process, one accumulation step


def _reference_steps(
    setup: dict[str, Any], rows: list[dict[str, Any]], loss_type: str, beta: float, steps: int
) -> list[tuple[float, float]]:
    """(loss, grad norm) of TRL's formula on the job's completions for ``steps`` AdamW steps (the same batch)."""
    model = copy.deepcopy(setup["model"]).float()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    prompts = [r["prompt_ids"] for r in rows]
    completions = [r["completion_ids"] for r in rows]
    adv = torch.tensor([r["advantage"] for r in rows], dtype=torch.float32)
    with torch.no_grad():
        old, _ = _logps(model, prompts, completions)
        ref = _logps(setup["ref"], prompts, completions)[0] if beta else None
    out = []
    for _ in range(steps):
        logp, mask = _logps(model, prompts, completions)
        loss = _trl_loss(loss_type, logp, old, ref, adv, mask, beta)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        out.append((float(loss), float(norm)))
    return out


MATRIX = list(itertools.product(["grpo", "bnpo", "dr_grpo", "dapo"], ["group", "batch", "none"], [0.0, BETA], [1, 2]))
FAST = [("dapo", "group", 0.0, 1), ("grpo", "batch", BETA, 2), ("dr_grpo", "none", BETA, 1), ("bnpo", "group", 0.0, 2)]


def _check(setup: dict[str, Any], tmp_path: Path, loss_type: str, scale: str, beta: float, mu: int) -> None:
    extra: dict[str, Any] = {"loss_type": loss_type, "scale_rewards": scale, "num_iterations": mu}
    if beta:
        extra["beta"] = beta
    ours, rows = _run(_spec(setup, mu, **extra), tmp_path / "run")
    first = [r for r in rows if r["iteration"] == 1]
    assert len(first) == GBS and len(rows) == GBS  # μ steps on one rollout
    rewards = torch.tensor([r["reward"] for r in first], dtype=torch.float32)
    assert float(rewards.std()) > 0, "the rewards must differ for the advantages to mean anything"
    theirs_adv = _trl_advantages(rewards, scale)
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in first]), theirs_adv, rtol=1e-6, atol=1e-6)
    theirs = _reference_steps(setup, first, loss_type, beta, mu)
    for step, (a, (loss, norm)) in enumerate(zip(ours, theirs, strict=True), start=1):
        assert a["lm_loss"] == pytest.approx(loss, rel=1e-4, abs=1e-7), f"step {step} loss"
        assert a["grad_norm"] == pytest.approx(norm, rel=1e-4), f"step {step} grad norm"
    if mu == 2:
        assert ours[1]["clip_ratio/region_mean"] > 0 or ours[1]["kl"] > 0  # step 2 is off the old policy


@pytest.mark.parametrize(("loss_type", "scale", "beta", "mu"), FAST)
def test_step_loss_and_grad_norm_equal_trls_formula(
    setup: dict[str, Any], tmp_path: Path, loss_type: str, scale: str, beta: float, mu: int
) -> None:
    _check(setup, tmp_path, loss_type, scale, beta, mu)


@pytest.mark.slow
@pytest.mark.parametrize(("loss_type", "scale", "beta", "mu"), [m for m in MATRIX if m not in FAST])
def test_the_whole_exactness_matrix(
    setup: dict[str, Any], tmp_path: Path, loss_type: str, scale: str, beta: float, mu: int
) -> None:
    _check(setup, tmp_path, loss_type, scale, beta, mu)


def test_a_resumed_run_continues_bit_identically(setup: dict[str, Any], tmp_path: Path) -> None:
    extra = {"num_iterations": 2, "beta": BETA, "save_interval": 2}
    whole, whole_rows = _run(_spec(setup, 4, save=str(tmp_path / "a"), **extra), tmp_path / "whole")
    _run(_spec(setup, 2, save=str(tmp_path / "b"), **extra), tmp_path / "part")
    resumed, resumed_rows = _run(_spec(setup, 4, save=str(tmp_path / "b"), **extra), tmp_path / "part")
    assert [r["completion_ids"] for r in resumed_rows] == [r["completion_ids"] for r in whole_rows]
    assert {r["iteration"] for r in whole_rows} == {1, 3}
    for a, b in zip(whole[2:], resumed[-2:], strict=True):
        assert (a["iteration"], a["lm_loss"], a["grad_norm"], a["reward"]) == (
            b["iteration"], b["lm_loss"], b["grad_norm"], b["reward"],
        )  # fmt: skip
