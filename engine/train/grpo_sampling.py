"""Stage grpo's sampler: one token per row of last-position logits, by inverse CDF on one uniform per row.

``torch.multinomial`` (what ``transformers`` samples with) draws an Exp(1) per vocabulary entry and takes
``argmax(p / q)``: on CPU that per-entry draw costs ten softmaxes over Qwen3's 151,936 tokens and dominated a rollout.
Inverse CDF needs one uniform per row: the row's unnormalised weights ``exp(logit - max)`` are summed in blocks of
``BLOCK`` (fp32, pairwise), the block sums accumulated in float64 pick the block, and the picked block's float64
cumulative sum picks the token: an exact categorical draw (up to fp32 weights, as the softmax it replaces) in about
one pass over the vocabulary. Top-k and top-p filter ``transformers``' way (temperature, then top-k, then top-p) on a
truncated candidate set where it is exact to: top-k's k candidates; top-p alone on the ``TOP_P_CANDIDATES`` most likely
when those hold the mass (else the full sort).

The uniforms are drawn up front, ``(steps, rows)`` per decode, each prompt's group from its own generator
(``engine.train.grpo_rollout.group_generator``): no Python per token or row, and a resumed run or a DP rank draws
exactly the numbers one uninterrupted process would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

BLOCK = 128  # vocabulary entries per fp32 partial sum (151,936 = 1,187 × 128)
TOP_P_CANDIDATES = 1024  # top-p alone: the candidates tried before sorting the whole vocabulary


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off


def draw_uniforms(
    generators: Sequence[torch.Generator | None], group: int, steps: int, device: torch.device
) -> torch.Tensor:
    """(steps, len(generators) · group) float64 uniforms in [0, 1): column block ``g`` from ``generators[g]``."""
    parts = [torch.rand((group, steps), generator=gen, dtype=torch.float64, device=device).t() for gen in generators]
    return torch.cat(parts, dim=1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index per row of (B, V) non-negative fp32 ``weights`` (at least one positive per row) drawn with probability
    weight / row sum, by the (B,) float64 uniforms ``u``; never an index of weight 0."""
    rows, vocab = weights.shape
    pad = -vocab % BLOCK
    if pad:
        weights = F.pad(weights, (0, pad))
    blocks = weights.view(rows, -1, BLOCK)
    block_sums = blocks.sum(dim=-1).double()
    cum = block_sums.cumsum(dim=-1)
    target = (u * cum[:, -1]).unsqueeze(-1)
    # the first block whose cumulative sum passes the target has weight; u < 1 keeps it in range (clamped anyway)
    b = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, b.unsqueeze(-1).expand(rows, 1, BLOCK)).squeeze(1).double()
    inner_cum = inner.cumsum(dim=-1)
    # rescale the residual to the block's float64 total (its fp32 sum differs by rounding) so it stays inside
    residual = (target - before) / block_sums.gather(1, b) * inner_cum[:, -1:]
    j = torch.searchsorted(inner_cum, residual, right=True)
    last_positive = BLOCK - 1 - (inner > 0).flip(-1).int().argmax(dim=-1, keepdim=True)
    j = torch.minimum(j, last_positive)  # a residual rounded onto the block's end: its last token with weight
    return (b * BLOCK + j).squeeze(-1)


def _candidates(logits: torch.Tensor, s: Sampling) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values, vocabulary ids) of the rows' candidates, most likely first, with top-k / top-p applied (dropped ones
    at -inf); None when the whole vocabulary stays (no filter) or top-p needs more than the truncated set."""
    vocab = logits.shape[-1]
    top_k = s.top_k if 0 < s.top_k < vocab else 0
    top_p = 0.0 < s.top_p < 1.0
    if not top_k and not top_p:
        return None
    k = top_k or min(TOP_P_CANDIDATES, vocab)
    values, ids = torch.topk(logits, k, dim=-1)
    if not top_p:
        return values, ids
    probs = values.softmax(dim=-1)
    if not top_k:
        # mass of the candidates under the full distribution: when it reaches top_p in every row, the kept set (each
        # token whose more likely tokens hold less than top_p) lies inside them
        full = (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        if bool((full.sum(dim=-1) < s.top_p).any()):
            return None
        probs = full
    above = probs.cumsum(dim=-1) - probs  # mass of the more likely candidates
    above[..., 0] = 0.0  # the most likely token stays
    return values.masked_fill(above >= s.top_p, float("-inf")), ids


def next_tokens(logits: torch.Tensor, s: Sampling, u: torch.Tensor, scratch: bool = False) -> torch.Tensor:
    """One token per row of (B, V) logits: temperature, then top-k, then top-p, drawn with the (B,) float64
    uniforms ``u``. ``scratch``: ``logits`` may be overwritten (the same numbers, no (B, V) temporaries)."""
    scratch = scratch and logits.dtype == torch.float32
    logits = logits.float()
    if s.temperature != 1.0:  # TRL's default 1: no (B, V) copy
        logits = logits.div_(s.temperature) if scratch else logits / s.temperature
    picked = _candidates(logits, s)
    if picked is not None:
        values, ids = picked
        weights = (values - values[:, :1]).exp()
        return ids.gather(1, _inverse_cdf(weights, u).unsqueeze(-1)).squeeze(-1)
    if 0.0 < s.top_p < 1.0:  # top-p beyond the truncated set: the whole vocabulary sorted (transformers' way)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        drop_sorted = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1.0 - s.top_p)
        drop_sorted[..., -1] = False  # the most likely token stays
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    top = logits.amax(dim=-1, keepdim=True)
    weights = logits.sub_(top) if scratch else logits - top
    return _inverse_cdf(weights.exp_(), u)
