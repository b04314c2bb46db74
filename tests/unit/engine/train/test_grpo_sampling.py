"""Stage grpo's sampler (``engine.train.grpo_sampling``): its draws follow the filtered distribution, never pick a
filtered or zero-probability token, and repeat exactly from the same generators."""

from __future__ import annotations

import pytest
import torch

from engine.model.sampling import SamplingParams, filter_logits
from engine.train.grpo_sampling import BLOCK, Sampling, draw_uniforms, next_tokens


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return 2.0 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def _frequencies(logits: torch.Tensor, s: Sampling, draws: int) -> torch.Tensor:
    """(vocab,) share of ``draws`` tokens sampled from the one row of ``logits``."""
    u = draw_uniforms([torch.Generator().manual_seed(3)], draws, 1, logits.device)[0]
    tokens = next_tokens(logits.expand(draws, -1), s, u)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / draws


@pytest.mark.parametrize(
    "s",
    [Sampling(), Sampling(temperature=0.7), Sampling(top_k=5), Sampling(top_p=0.8), Sampling(top_k=7, top_p=0.6)],
    ids=["plain", "temperature", "top_k", "top_p", "top_k_top_p"],
)
def test_draws_follow_the_filtered_distribution(s: Sampling) -> None:
    # a vocabulary over two blocks with a ragged tail, so the block search and the padding are both exercised
    logits = _logits(1, 2 * BLOCK + 37, seed=1)
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    expected = filter_logits(logits, params).softmax(dim=-1)[0].double()  # transformers' order, temperature first
    freq = _frequencies(logits, s, draws=40_000)
    assert torch.all(freq[expected == 0] == 0), "a filtered token was drawn"
    # 40,000 draws: a share's standard error is at most 0.0025; 0.012 is ~5 of them
    assert float((freq - expected).abs().max()) < 0.012


def test_top_p_over_the_truncated_set_falls_back_to_the_full_sort() -> None:
    # a near-uniform row: top-p 0.9 keeps far more than the truncated candidate set
    logits = 0.01 * _logits(2, 3000, seed=2)
    expected = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.9)).isfinite()
    u = draw_uniforms([torch.Generator().manual_seed(0)], 2, 200, logits.device)
    for row in u:
        tokens = next_tokens(logits, Sampling(top_p=0.9), row)
        assert bool(expected.gather(1, tokens[:, None]).all())


def test_never_draws_a_zero_weight_token_at_the_edges() -> None:
    logits = torch.full((4, 3 * BLOCK), float("-inf"))
    logits[0, 5] = 0.0  # a single token
    logits[1, [BLOCK - 1, 2 * BLOCK]] = 0.0  # a block's last entry and the next block's first
    logits[2, -1] = 0.0  # the very last entry
    logits[3, [0, 3 * BLOCK - 1]] = torch.tensor([0.0, -120.0])  # exp(-120) is 0 in fp32
    u = torch.tensor([0.0, 1.0 - 2.0**-53, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    tokens = next_tokens(logits, Sampling(), u).tolist()
    assert tokens[0] == 5 and tokens[1] == 2 * BLOCK and tokens[2] == 3 * BLOCK - 1 and tokens[3] == 0


def test_uniforms_come_from_each_groups_own_generator() -> None:
    gens = [torch.Generator().manual_seed(s) for s in (11, 12)]
    u = draw_uniforms(gens, 3, 5, torch.device("cpu"))
    assert u.shape == (5, 6) and u.dtype == torch.float64
    again = draw_uniforms([torch.Generator().manual_seed(12)], 3, 5, torch.device("cpu"))
    assert torch.equal(u[:, 3:], again)  # group 1's columns do not depend on group 0's generator
    logits = _logits(6, 1000, seed=4)
    assert torch.equal(next_tokens(logits, Sampling(), u[0]), next_tokens(logits, Sampling(), u[0].clone()))
