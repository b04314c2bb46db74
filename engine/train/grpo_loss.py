"""Stage grpo's formulas, on plain tensors: group advantages, the per-token clipped surrogate with the k3 KL, and
the four aggregations of TRL's ``loss_type``.

Advantages (TRL's ``GRPOTrainer``, "sum_then_normalize"): each prompt's ``num_generations`` rewards are one group;
``A = r - mean(group)``, divided by ``std + eps`` where std is Bessel-corrected and taken over the group
(``scale_rewards`` "group"), the whole batch ("batch") or not at all ("none": Dr. GRPO). TRL adds 1e-4 to the std,
MindSpeed-RL and verl 1e-6 (``advantage_eps``); both in the rewards' own dtype, so float64 rewards give
MindSpeed-RL's figure.

Per token: ``ρ = exp(logp - old_logp)``, ``loss = -min(ρ·A, clip(ρ, 1-ε_low, 1+ε_high)·A) + β·k3`` with
``k3 = exp(ref - logp) - (ref - logp) - 1``; ``kl_clamp`` (MindSpeed-RL) clamps ``ref - logp`` to ±20 and k3 to ±10.

Aggregation: a micro-batch gives a numerator (``aggregate``), the step divides by a denominator counted over the
whole global batch (``Denominator``), so the gradient is TRL's whatever the micro-batch split:
``grpo`` Σ_seq(seq token mean) / sequences; ``bnpo`` Σ_mb(mb token mean) / micro-batches; ``dr_grpo``
Σ tokens / (sequences × max_completion_length); ``dapo`` Σ tokens / tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
KL_LOG_RATIO_CLAMP = 20.0  # MindSpeed-RL's clamp of ref - logp
KL_TERM_CLAMP = 10.0  # and of the k3 term


def group_advantages(rewards: torch.Tensor, group: int, scale: ScaleRewards, eps: float) -> torch.Tensor:
    """(N,) rewards, ``group`` consecutive completions per prompt -> (N,) advantages, in the rewards' dtype."""
    grouped = rewards.view(-1, group)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    if scale == "group":
        std = grouped.std(dim=1).repeat_interleave(group)
    else:
        std = rewards.std().expand_as(rewards)
    return centred / (std + eps)


def group_std_is_zero(rewards: torch.Tensor, group: int, scale: ScaleRewards) -> torch.Tensor:
    """(N,) bool: the std the advantages were scaled by (the group's for "none" too) is zero (TRL's
    ``frac_reward_zero_std``)."""
    if scale == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        std = rewards.view(-1, group).std(dim=1).repeat_interleave(group)
    return torch.isclose(std, torch.zeros_like(std))


@dataclasses.dataclass(frozen=True)
class SurrogateConfig:
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    kl_clamp: bool = False


@dataclasses.dataclass
class TokenTerms:
    """Per completion token: the loss, and what TRL reports (detached): k3 KL, and which ratios were clipped."""

    loss: torch.Tensor
    kl: torch.Tensor | None
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor


def k3(logp: torch.Tensor, ref_logp: torch.Tensor, clamp: bool) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference) per token (Schulman), optionally MindSpeed-RL's clamps."""
    delta = ref_logp - logp
    if clamp:
        delta = delta.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    kl = torch.exp(delta) - delta - 1
    return kl.clamp(-KL_TERM_CLAMP, KL_TERM_CLAMP) if clamp else kl


def token_terms(
    cfg: SurrogateConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None,
) -> TokenTerms:
    """All (N,) per token; ``advantages`` already expanded to the tokens of each sequence."""
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if cfg.beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta: the KL term needs the reference's log-probs")
        kl = k3(logp, ref_logp, cfg.kl_clamp)
        loss = loss + cfg.beta * kl
        kl = kl.detach()
    with torch.no_grad():
        low = (ratio < 1 - cfg.epsilon_low) & (advantages < 0)
        high = (ratio > 1 + cfg.epsilon_high) & (advantages > 0)
    return TokenTerms(loss, kl, low, high)


def aggregate(
    loss_type: LossType,
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    seq: torch.Tensor,
    sequences: int,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """A micro-batch's numerator: ``token_loss`` and ``mask`` (N,) over its completion tokens, ``seq`` (N,) each
    token's sequence (0..sequences-1). ``counts`` (sequences,): each sequence's masked tokens where this rank holds
    only some of them (context parallelism: the CP ranks' numerators then add up to the micro-batch's); None: the
    tokens given are every token of the micro-batch."""
    masked = token_loss * mask
    if counts is None:
        counts = torch.zeros(sequences, dtype=mask.dtype, device=mask.device).index_add(0, seq, mask)
    counts = counts.to(mask.dtype)
    if loss_type == "grpo":
        sums = torch.zeros(sequences, dtype=masked.dtype, device=masked.device).index_add(0, seq, masked)
        return (sums / counts.clamp(min=1.0)).sum()
    if loss_type == "bnpo":
        return masked.sum() / counts.sum().clamp(min=1.0)
    return masked.sum()


def denominator(
    loss_type: LossType, sequences: int, micro_batches: int, tokens: float, max_completion_length: int
) -> float:
    """What the step's summed numerators are divided by, counted over the global batch (``aggregate``)."""
    if loss_type == "grpo":
        return float(sequences)
    if loss_type == "bnpo":
        return float(micro_batches)
    if loss_type == "dr_grpo":
        return float(sequences * max_completion_length)
    return max(tokens, 1.0)
