"""Next-token selection: greedy, and temperature/top-k/top-p filters equal to transformers' warpers."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from engine.model.sampling import SamplingParams, filter_logits, next_tokens


def _logits(seed: int = 0, b: int = 4, v: int = 50) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.00001), SamplingParams(temperature=1.0, top_k=1)],
)
def test_greedy_is_argmax(params: SamplingParams) -> None:
    logits = _logits()
    assert params.greedy and params.generator() is None
    assert torch.equal(next_tokens(logits, params), logits.argmax(-1))


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.7, 0, 0.0), (1.0, 5, 0.0), (0.7, 0, 0.9), (1.3, 10, 0.5), (1.0, 0, 0.05)]
)
def test_filters_match_transformers(temperature: float, top_k: int, top_p: float) -> None:
    logits = _logits(1)
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = filter_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got[~torch.isinf(got)], expected[~torch.isinf(expected)])


def test_top_k_keeps_k_tokens_and_top_p_keeps_at_least_one() -> None:
    logits = _logits(2)
    kept = ~torch.isinf(filter_logits(logits, SamplingParams(temperature=1.0, top_k=7)))
    assert kept.sum(-1).tolist() == [7] * logits.shape[0]
    kept = ~torch.isinf(filter_logits(logits, SamplingParams(temperature=1.0, top_p=1e-6)))
    assert kept.sum(-1).tolist() == [1] * logits.shape[0]
    assert torch.equal(kept.nonzero()[:, 1], logits.argmax(-1))


def test_sampling_is_reproducible_with_a_seed_and_stays_in_the_filtered_set() -> None:
    logits = _logits(3, b=64)
    params = SamplingParams(temperature=1.0, top_k=3, seed=7)
    a = next_tokens(logits, params, params.generator())
    b = next_tokens(logits, params, params.generator())
    c = next_tokens(logits, params, SamplingParams(temperature=1.0, top_k=3, seed=8).generator())
    assert torch.equal(a, b) and not torch.equal(a, c)
    top3 = logits.topk(3, dim=-1).indices
    assert bool((top3 == a[:, None]).any(-1).all())


def test_bad_params_name_the_field() -> None:
    with pytest.raises(ValueError, match="^top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="^temperature"):
        SamplingParams(temperature=-1)
