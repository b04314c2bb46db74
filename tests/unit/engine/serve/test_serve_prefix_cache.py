"""Prefix caching (``engine.serve.slots``) on the demo model with the real Qwen3 tokenizer: a shared system prompt
and a multi-turn conversation are computed once and reused, and greedy outputs equal those with caching off, whether
the prefix is taken from a free slot in place or copied from a busy one."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from cli.demo import tokenizer_source
from engine.contract.model_config import preset
from engine.model.qwen3 import Qwen3Model
from engine.serve.batcher import Batcher, Sequence
from engine.serve.job import prefix_cache_hit_rate
from engine.serve.sampling import RequestOptions
from engine.serve.slots import BLOCK, SlotCache

SYSTEM = "You are the support assistant of a bank. " * 12  # ~100 tokens shared by every conversation


@pytest.fixture(scope="module")
def demo():
    model = Qwen3Model(preset("qwen3-tiny-tied"))
    model.init_weights(seed=0)
    return model.eval(), AutoTokenizer.from_pretrained(str(tokenizer_source()))


def _chat(tok, turns: list[tuple[str, str]]) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for role, text in turns:
        msgs.append({"role": role, "content": text})
    return tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False, return_dict=False)


def _run(model, prompts: list[list[int]], caching: bool, slots: int = 2, budget: int = 512) -> list[Sequence]:
    """Submit the prompts one after another (each once the previous has its slot), step until all are done."""
    batcher = Batcher(model, SlotCache(model.cfg, slots, 512), set(), max_batched_tokens=budget, prefix_caching=caching)
    seqs = [Sequence(p, RequestOptions(temperature=0.0), 6) for p in prompts]
    for seq in seqs:
        batcher.submit([seq])
        batcher.step()
    while batcher.busy:
        batcher.step()
    assert all(s.finish_reason == "length" for s in seqs)
    return seqs


def test_shared_system_prompt_is_reused_and_exact(demo) -> None:
    model, tok = demo
    prompts = [_chat(tok, [("user", q)]) for q in ("Where is my card?", "Close my account.", "What is my balance?")]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1], strict=False)) if a != b)
    off = _run(model, prompts, caching=False)
    on = _run(model, prompts, caching=True)
    assert [s.output for s in on] == [s.output for s in off]
    assert [s.cached for s in off] == [0, 0, 0]
    # the 2nd copies the system prompt's blocks from the busy 1st; the 3rd finds them in a slot as well
    assert on[0].cached == 0 and on[1].cached == on[2].cached == shared // BLOCK * BLOCK > 90


def test_multi_turn_conversation_reuses_its_history(demo) -> None:
    model, tok = demo
    first = _chat(tok, [("user", "I lost my card yesterday.")])
    (turn1,) = _run(model, [first], caching=False, slots=1)
    answer = tok.decode(turn1.output, skip_special_tokens=True)
    second = _chat(tok, [("user", "I lost my card yesterday."), ("assistant", answer), ("user", "And now?")])
    off = _run(model, [first, second], caching=False, slots=1)
    on = _run(model, [first, second], caching=True, slots=1)  # one slot: turn 2 reuses turn 1's slot in place
    assert [s.output for s in on] == [s.output for s in off]
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    # the whole history up to where the template renders turn 1's answer differently (its empty think block)
    assert on[1].cached == min(common, len(second) - 1) // BLOCK * BLOCK >= len(first) - 2 * BLOCK


def test_hit_rate_counts_prompt_tokens(demo) -> None:
    model, tok = demo
    prompts = [_chat(tok, [("user", "Hello.")])] * 2  # the same prompt twice: all but its last partial block hit
    batcher = Batcher(model, SlotCache(model.cfg, 1, 512), set())
    for prompt in prompts:
        batcher.submit([Sequence(prompt, RequestOptions(temperature=0.0), 2)])
        while batcher.busy:
            batcher.step()
    hits = (len(prompts[0]) - 1) // BLOCK * BLOCK
    assert batcher.stats["prefix_cache_hits"] == hits
    assert prefix_cache_hit_rate(batcher.stats) == pytest.approx(hits / (2 * len(prompts[0])))


def test_index_matches_blocks_of_the_same_tokens_and_adapter_only() -> None:
    cache = SlotCache(preset("qwen3-tiny"), 2, 64)
    slot = cache.acquire()
    assert slot is not None
    cache.keys[0][slot, :, :40] = torch.arange(40.0)[None, :, None]
    cache.view([slot], [40]).commit([list(range(40))])
    assert cache.match(list(range(50))) == (slot, 32)
    assert cache.match(list(range(32))) == (slot, 16)  # one token is always left to prefill
    assert cache.match(list(range(50)), adapter=1) == (None, 0)
    assert cache.match([99, *range(1, 50)]) == (None, 0)
    other = cache.acquire()
    assert other is not None
    cache.copy_prefix(slot, other, 32)
    assert torch.equal(cache.keys[0][other, :, :32], cache.keys[0][slot, :, :32]) and cache.lengths[other] == 32
    cache.release(slot)
    assert cache.acquire(slot, keep=16) == slot and cache.lengths[slot] == 16
    cache.release(other)
    assert cache.acquire(other, keep=0) == other
    assert cache.match(list(range(50))) == (slot, 16)  # what both slots held past 16 is forgotten
