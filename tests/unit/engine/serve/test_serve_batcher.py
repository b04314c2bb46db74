"""The serving loop (``engine.serve.batcher``) decodes greedily exactly as ``transformers.generate`` does, one prompt
at a time, while sequences join mid-flight, prompts are prefilled in small chunks and slots are reused; dense and
MoE. Sampling options (seed, penalties, logprobs) act as documented."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine.contract.model_config import preset
from engine.model.attention import AttentionPlan
from engine.model.hf_mapping import native_from_hf
from engine.model.qwen3 import Qwen3Model
from engine.serve.batcher import Batcher, QueueFull, Sequence
from engine.serve.sampling import RequestOptions, apply_penalties
from engine.serve.slots import SlotCache, SlotView
from tests.unit.moe_support import hf_pair

STOP = 1


@pytest.fixture(scope="module")
def dense():
    cfg = dataclasses.replace(preset("qwen3-tiny"), vocab_size=512)  # a small head keeps the test quick
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**{**cfg.to_hf("float32"), "initializer_range": 0.5})).eval()
    ours = Qwen3Model(cfg)
    ours.load_state_dict(dict(native_from_hf(hf.state_dict().__getitem__, cfg)), strict=True)
    return hf, ours.eval()


@pytest.fixture(scope="module")
def moe():
    return hf_pair(seed=11, initializer_range=0.5)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(12)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (9, 3, 14, 6)]


def _hf_one(hf, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=[STOP]
        )
    return out[0, len(prompt) :].tolist()


def _serve(model: Qwen3Model, prompts: list[list[int]], max_new: int, slots: int, chunk: int) -> list[list[int]]:
    """Submit prompts one per step (so they join a running batch), step until all are done."""
    cache = SlotCache(model.cfg, slots, 64)
    batcher = Batcher(model, cache, {STOP}, prefill_chunk=chunk)
    seqs = [Sequence(p, RequestOptions(temperature=0.0), max_new) for p in prompts]
    pending = list(seqs)
    while pending or batcher.busy:
        if pending:
            batcher.submit([pending.pop(0)])
        batcher.step()
    assert all(s.finish_reason in ("stop", "length") for s in seqs)
    assert sorted(cache.free) == list(range(slots))  # every slot came back
    return [s.output for s in seqs]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_equals_transformers_generate(kind, request) -> None:
    hf, ours = request.getfixturevalue(kind)
    prompts = _prompts(ours.cfg.vocab_size)
    expected = [_hf_one(hf, p, 8) for p in prompts]
    assert sum(map(len, expected)) >= 24
    # 3 slots for 4 prompts: later prompts wait for a slot; chunks of 4 split every prompt but the shortest
    assert _serve(ours, prompts, 8, slots=3, chunk=4) == expected


def test_queue_full_is_refused(dense) -> None:
    _, ours = dense
    batcher = Batcher(ours, SlotCache(ours.cfg, 1, 16), {STOP}, max_waiting=2)
    batcher.submit([Sequence([2, 3], RequestOptions(), 2) for _ in range(2)])
    with pytest.raises(QueueFull):
        batcher.submit([Sequence([2, 3], RequestOptions(), 2)])


def test_cancelled_sequence_frees_its_slot(dense) -> None:
    _, ours = dense
    cache = SlotCache(ours.cfg, 1, 32)
    batcher = Batcher(ours, cache, set())
    seq = Sequence([5, 6, 7], RequestOptions(temperature=0.0), 20)
    batcher.submit([seq])
    batcher.step()
    seq.cancel()
    batcher.step()
    assert seq.finish_reason == "abort" and cache.free == [0] and not batcher.busy


def test_seeded_sampling_repeats_and_logprobs_are_reported(dense) -> None:
    _, ours = dense

    def run(seed: int) -> list[Sequence]:
        batcher = Batcher(ours, SlotCache(ours.cfg, 2, 32), set())
        opts = RequestOptions(temperature=1.0, top_k=50, seed=seed, n=2, logprobs=3)
        seqs = [Sequence([5, 6, 7], opts, 8, index=i) for i in range(2)]
        batcher.submit(seqs)
        while batcher.busy:
            batcher.step()
        return seqs

    a, b, c = run(7), run(7), run(8)
    assert [s.output for s in a] == [s.output for s in b]
    assert [s.output for s in a] != [s.output for s in c]
    assert a[0].output != a[1].output  # the n choices use different seeds
    picks = []
    while (p := a[0].events.get_nowait()[1]) is not None:
        picks.append(p)
    assert [p.token for p in picks] == a[0].output
    assert all(p.logprob is not None and p.logprob <= 0 and len(p.top or []) == 3 for p in picks)


def test_penalties() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    rep = apply_penalties(logits, RequestOptions(repetition_penalty=2.0), prompt=[0], output=[1])
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5]
    freq = apply_penalties(logits, RequestOptions(frequency_penalty=0.5, presence_penalty=0.25), [0], [2, 2, 3])
    assert freq.tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]
    with pytest.raises(ValueError, match="top_p"):
        RequestOptions(top_p=0.0)


def test_a_whole_prompt_attends_causally_without_a_mask(dense, monkeypatch) -> None:
    """A prompt from column 0 runs SDPA's causal kernel (no mask to build or read), with the masked path's numbers
    bit for bit; a later chunk (it starts after its slot's first columns) keeps its mask."""
    _, model = dense
    prompt = _prompts(model.cfg.vocab_size)[2]  # 14 tokens

    def hidden(masked: bool) -> tuple[torch.Tensor, list[AttentionPlan]]:
        cache = SlotCache(model.cfg, 2, 64)
        batcher, plans = Batcher(model, cache, {STOP}), []
        plain_view = cache.view

        def view(slots: list[int], counts: list[int]) -> SlotView:
            v = plain_view(slots, counts)
            for g in v.groups:
                if masked:  # the mask the view built before: query k sees columns <= k
                    tril = torch.ones(g.new, g.width, dtype=torch.bool).tril()[None, None]
                    g.plan = AttentionPlan(mask=tril, is_causal=False, native_gqa=True)
                plans.append(g.plan)
            return v

        monkeypatch.setattr(cache, "view", view)
        out = batcher._compute([0], [0], [prompt[:10]])
        batcher._compute([0], [0], [prompt[10:]])  # the rest, after the first 10 columns
        return out, plans

    (fast, plans), (masked, _) = hidden(masked=False), hidden(masked=True)
    assert plans[0].mask is None and plans[0].is_causal  # the whole first chunk: causal, no mask
    assert plans[1].mask is not None and not plans[1].is_causal  # the later chunk: masked from its start
    assert torch.equal(fast, masked)
