"""The serving loop's scheduler (``engine.serve.batcher``): every waiting request that finds a free slot starts at
once, prompts are chunked within the per-step token budget (``max_num_batched_tokens``) after the decodes, and the
batched, right-padded forwards decode greedily exactly as one prompt at a time does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.contract.model_config import preset
from engine.model.qwen3 import Qwen3Model
from engine.serve.batcher import Batcher, Sequence
from engine.serve.sampling import RequestOptions
from engine.serve.slots import SlotCache


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    torch.manual_seed(0)
    model = Qwen3Model(dataclasses.replace(preset("qwen3-tiny"), vocab_size=512))
    model.init_weights(seed=3)
    return model.eval()


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(2, 512, (n,), generator=gen).tolist() for n in lengths]


def _batcher(model: Qwen3Model, slots: int, budget: int) -> Batcher:
    return Batcher(model, SlotCache(model.cfg, slots, 128), set(), max_batched_tokens=budget, prefix_caching=False)


def test_every_waiting_request_with_a_slot_gets_its_first_token_in_one_step(model) -> None:
    batcher = _batcher(model, slots=8, budget=256)
    seqs = [Sequence(p, RequestOptions(temperature=0.0), 4) for p in _prompts((20, 3, 17, 9, 30, 11, 5, 25))]
    batcher.submit(seqs)
    batcher.step()
    assert [len(s.output) for s in seqs] == [1] * 8


def test_prompts_are_chunked_within_the_budget_left_by_the_decodes(model) -> None:
    batcher = _batcher(model, slots=4, budget=24)
    decoding = [Sequence(p, RequestOptions(temperature=0.0), 50) for p in _prompts((4, 4, 4))]
    batcher.submit(decoding)
    batcher.step()
    long = Sequence(_prompts((60,))[0], RequestOptions(temperature=0.0), 2)
    batcher.submit([long])
    progress = []
    while not long.output:
        batcher.step()
        progress.append(long.prefilled)
    # 3 decodes leave 21 tokens of each step's 24 to the prompt: 21, 42, then its last 18 and its first token
    assert progress == [21, 42, 60]
    assert all(len(s.output) == 1 + len(progress) for s in decoding)


def test_batched_steps_decode_as_one_prompt_at_a_time(model) -> None:
    prompts = _prompts((40, 3, 17, 9, 33))

    def serve(slots: int, budget: int, together: bool) -> list[list[int]]:
        batcher = _batcher(model, slots, budget)
        seqs = [Sequence(p, RequestOptions(temperature=0.0), 6) for p in prompts]
        if together:
            batcher.submit(seqs)
        for seq in seqs:
            if not together:
                batcher.submit([seq])
            while not together and batcher.busy:
                batcher.step()
        while batcher.busy:
            batcher.step()
        return [s.output for s in seqs]

    alone = serve(slots=1, budget=2048, together=False)
    assert serve(slots=5, budget=2048, together=True) == alone  # one step prefills all, padded in groups
    assert serve(slots=3, budget=16, together=True) == alone  # small chunks, rows joining as slots free up
