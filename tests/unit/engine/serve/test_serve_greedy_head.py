"""The bf16 greedy head (``engine.serve.greedy_head``): its error bound holds on this machine's kernels, it picks the
fp32 head's token where bf16 alone would pick another, it hands a row back to the full head when the bound cannot
decide, and through the serving loop greedy outputs are the same with and without it (dense and MoE, the real
vocabulary) while sampled rows, log-probabilities and penalties are untouched."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine.contract.model_config import preset
from engine.model.qwen3 import Qwen3Model
from engine.serve import greedy_head
from engine.serve.batcher import Batcher, Sequence
from engine.serve.greedy_head import GreedyHead
from engine.serve.sampling import RequestOptions
from engine.serve.slots import SlotCache
from tests.unit.moe_support import hf_pair

STOP = 1


def _rows(vocab: int, hidden: int, scale: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * scale
    return weight, torch.randn(16, hidden, generator=gen)


@pytest.mark.parametrize(("hidden", "scale"), [(64, 0.05), (512, 1.0), (512, 1e-3), (1536, 30.0)])
def test_the_bf16_error_stays_within_the_bound(hidden: int, scale: float) -> None:
    weight, h = _rows(4096, hidden, scale, seed=hidden)
    weight[0] = h[0].abs() * scale  # a row aligned with a state: every product adds up the same way
    head = GreedyHead(weight)
    low = head.low(h.bfloat16()).double()
    exact = h.double() @ weight.double().t()
    err = (low - exact).abs().amax(dim=1)
    bound = head.margin(h).double() / 2  # the margin is 2E plus the fp32 head's own rounding
    assert bool((err <= bound).all()), (err / bound).max()
    assert float((err / bound).max()) > 0.01  # the bound is not vacuous


def _flip_case(crowd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token 1's fp32 logit beats token 0's by 0.002, but both round to the same bf16 logit (bf16's argmax: 0);
    ``crowd`` more tokens sit just below them, the rest far below."""
    vocab, hidden = 256, 8
    weight = torch.zeros(vocab, hidden)
    weight[:, 0] = -4.0
    weight[0, 0], weight[1, 0] = 1.001, 1.003
    weight[2 : 2 + crowd, 0] = 1.0
    h = torch.zeros(1, hidden)
    h[0, 0] = 1.0
    return weight, h


def test_the_fp32_rescore_picks_the_token_bf16_would_flip() -> None:
    weight, h = _flip_case(crowd=10)
    head = GreedyHead(weight)
    low = head.low(h.bfloat16())
    assert int(low.argmax()) == 0 and int((h @ weight.t()).argmax()) == 1  # bf16 alone would pick 0
    assert head.argmax(h) == [1]


def test_a_crowded_top_falls_back_to_the_full_head() -> None:
    weight, h = _flip_case(crowd=greedy_head.CANDIDATES)  # the k-th bf16 logit is within the margin of the best
    assert GreedyHead(weight).argmax(h) == [None]
    assert GreedyHead(weight).argmax(h * float("nan")) == [None]  # a non-finite state: the full head checks it


def test_only_plain_fp32_cpu_heads_take_it() -> None:
    model = Qwen3Model(dataclasses.replace(preset("qwen3-tiny"), vocab_size=512))
    head = GreedyHead.for_model(model)
    assert head is not None
    # this build's oneDNN packs the bf16 weight once (the bound tests above run on the packed product)
    assert head.low.packed is not None or not torch.backends.mkldnn.is_available()
    assert GreedyHead.for_model(copy.deepcopy(model).to(torch.bfloat16)) is None


# ------------------------------------------------------------------ through the serving loop


@pytest.fixture(scope="module")
def dense() -> Qwen3Model:
    torch.manual_seed(0)
    model = Qwen3Model(preset("qwen3-tiny"))  # the real 151,936-token vocabulary
    model.init_weights(seed=0)
    return model.eval()


@pytest.fixture(scope="module")
def moe() -> Qwen3Model:
    return hf_pair(seed=11, initializer_range=0.5)[1]


def _serve(model: Qwen3Model, seqs: list[Sequence], fast: bool) -> tuple[list[list[int]], int]:
    """Serve ``seqs`` (two joining per step) on a copy of ``model``; the outputs and the rows the bf16 head decided."""
    batcher = Batcher(copy.deepcopy(model), SlotCache(model.cfg, 4, 64), {STOP}, bf16_greedy_head=fast)
    decided = 0
    if batcher.greedy_head is not None:
        head, original = batcher.greedy_head, batcher.greedy_head.argmax

        def counting(hidden: torch.Tensor) -> list[int | None]:
            nonlocal decided
            picks = original(hidden)
            decided += sum(p is not None for p in picks)
            return picks

        head.argmax = counting  # type: ignore[method-assign]
    pending = list(seqs)
    while pending or batcher.busy:
        batcher.submit(pending[:2])
        del pending[:2]
        batcher.step()
    assert all(s.finish_reason in ("stop", "length") for s in seqs)
    return [s.output for s in seqs], decided


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(12)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (9, 3, 14, 6, 11, 5)]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_outputs_are_the_same_with_and_without_it(kind: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(kind)

    def seqs() -> list[Sequence]:
        return [Sequence(p, RequestOptions(temperature=0.0), 10) for p in _prompts(model.cfg.vocab_size)]

    without, none = _serve(model, seqs(), fast=False)
    with_it, decided = _serve(model, seqs(), fast=True)
    assert with_it == without and none == 0
    assert decided >= 0.8 * sum(map(len, with_it))  # the bf16 head decided most tokens, not the fallback


def test_every_row_falling_back_gives_the_same_outputs(dense, monkeypatch) -> None:
    monkeypatch.setattr(greedy_head, "CANDIDATES", 1)  # the k-th is the best: never decided by bf16
    seqs = [Sequence(p, RequestOptions(temperature=0.0), 6) for p in _prompts(dense.cfg.vocab_size)]
    expected = _serve(dense, [dataclasses.replace(s) for s in seqs], fast=False)[0]
    assert _serve(dense, seqs, fast=True) == (expected, 0)


def test_sampled_rows_and_logprobs_are_untouched(dense) -> None:
    options = [
        RequestOptions(temperature=1.0, seed=3),
        RequestOptions(temperature=0.0, logprobs=2),
        RequestOptions(temperature=0.0, repetition_penalty=1.3),
        RequestOptions(temperature=0.7, top_p=0.9, seed=5, frequency_penalty=0.5),
        RequestOptions(temperature=0.0),
    ]

    def seqs() -> list[Sequence]:
        return [Sequence(p, o, 8) for p, o in zip(_prompts(dense.cfg.vocab_size), options, strict=False)]

    plain, with_it = seqs(), seqs()
    assert _serve(dense, plain, fast=False)[0] == _serve(dense, with_it, fast=True)[0]
    picks = [[pick for _, pick in list(s.events.queue) if pick is not None] for s in (plain[1], with_it[1])]
    assert [(p.token, p.logprob, p.top) for p in picks[0]] == [(p.token, p.logprob, p.top) for p in picks[1]]
    assert all(p.logprob is not None and len(p.top or []) == 2 for p in picks[1])


@pytest.mark.parametrize("vocab", [100, 4096, 4096 + 77])
def test_the_candidates_are_every_token_within_the_margin(vocab: int) -> None:
    """The block-maxima pass finds exactly the tokens whose bf16 logit is within the margin of the row's best (a
    vocabulary shorter than a block, a multiple of it, one with a shorter last block), and the pick is fp32's."""
    weight, h = _rows(vocab, 64, 0.05, seed=vocab)
    head = GreedyHead(weight)
    low = head.low(h.bfloat16())
    margin = head.margin(h)
    safe = torch.ones(len(h), dtype=torch.bool)
    safe[3] = False  # an unsafe row has none
    rows, ids = greedy_head._within(low, margin * 4, safe)
    exact = low.double()
    want = (exact >= exact.amax(dim=1, keepdim=True) - 4 * margin.double()[:, None]).nonzero().tolist()
    assert sorted(zip(rows.tolist(), ids.tolist(), strict=True)) == [(r, v) for r, v in want if r != 3]
    assert len(want) > 2 * len(h)  # rows with several candidates, not only each row's best
    picks, full = head.argmax(h), (h @ weight.t()).argmax(dim=1).tolist()
    assert sum(p is not None for p in picks) >= len(h) // 2
    assert all(p is None or p == f for p, f in zip(picks, full, strict=True))
