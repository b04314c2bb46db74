"""Stage grpo's formulas against their anchors: advantages against TRL's own code (its ``nanstd``, the lines of its
``GRPOTrainer``) and MindSpeed-RL's (eps 1e-6 in float64); the surrogate and the four aggregations against TRL's
padded (B, T) formulation written out here, on random tensors."""

from __future__ import annotations

import pytest
import torch

from engine.train.grpo_loss import SurrogateConfig, aggregate, denominator, group_advantages, token_terms

G = 4


def _rewards() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (16,), generator=g).float()
    r[:G] = 1.0  # one group with zero std
    return r


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(scale: str) -> None:
    from trl.trainer.utils import nanstd

    rewards = _rewards()
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
    theirs = rewards - mean
    if scale != "none":
        theirs = theirs / (std + 1e-4)
    ours = group_advantages(rewards, G, scale, 1e-4)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)  # TRL's nanstd rounds differently in fp32


def test_advantages_equal_mindspeed_rls() -> None:
    """MindSpeed-RL's group normalisation (compute_group_norm_advantage_return): float64, eps 1e-6."""
    rewards = _rewards().double()
    scores = rewards.reshape(-1, G)
    theirs = ((scores - scores.mean(dim=1, keepdim=True)) / (scores.std(dim=1, keepdim=True) + 1e-6)).reshape(-1)
    ours = group_advantages(rewards, G, "group", 1e-6)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-15)


def _padded_trl_loss(loss_type: str, cfg: SurrogateConfig, logp, old, ref, adv, mask, max_len: int) -> torch.Tensor:
    """TRL's ``_compute_loss`` on one (B, T) batch (no gradient accumulation)."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if cfg.beta:
        per_token = per_token + cfg.beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_len)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_aggregations_equal_trls_padded_formula(loss_type: str, beta: float) -> None:
    g = torch.Generator().manual_seed(1)
    b, t = 6, 9
    lengths = torch.tensor([9, 3, 5, 1, 7, 9])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)  # some ratios outside the clip
    ref = logp + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    cfg = SurrogateConfig(beta=beta, epsilon_low=0.2, epsilon_high=0.28)
    theirs = _padded_trl_loss(loss_type, cfg, logp, old, ref, adv, mask, t)
    keep = mask.bool()
    seq = torch.arange(b)[:, None].expand(b, t)[keep]
    terms = token_terms(cfg, logp[keep], old[keep], adv[seq], ref[keep])
    num = aggregate(loss_type, terms.loss, mask[keep], seq, b)  # type: ignore[arg-type]
    ours = num / denominator(loss_type, b, 1, float(mask.sum()), t)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    assert bool(terms.low_clipped.any() or terms.high_clipped.any())


def test_kl_clamp_bounds_the_term() -> None:
    cfg = SurrogateConfig(beta=1.0, kl_clamp=True)
    logp, ref = torch.tensor([-30.0, -1.0]), torch.tensor([0.0, -1.0])
    terms = token_terms(cfg, logp, logp.clone(), torch.zeros(2), ref)
    assert terms.kl is not None and terms.kl.tolist() == [10.0, 0.0]
