"""Greedy decoding of a tiny Qwen3-MoE with ``engine.eval.generate`` equals ``transformers.generate`` token for token
(KV cache and recompute, batch 1 and left-padded batches)."""

from __future__ import annotations

import pytest
import torch

from engine.eval.generate import DecodeOptions, generate
from engine.model.qwen3 import Qwen3Model
from tests.unit.moe_support import VOCAB, hf_pair

PAD, STOP = 0, 1


@pytest.fixture(scope="module")
def models():
    # A wider init gives the random model clear argmax margins, so fp32 rounding order cannot flip a token.
    return hf_pair(seed=11, initializer_range=0.5)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(12)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (9, 3, 6)]


def _hf_generate(hf, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=[STOP],
            pad_token_id=PAD,
        )
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t == STOP), len(row))
        rows.append(row[:cut])
    return rows


@pytest.fixture(scope="module")
def expected(models, prompts) -> list[list[int]]:
    rows = _hf_generate(models[0], prompts, 10)
    assert sum(map(len, rows)) >= 20  # most rows really decode several tokens
    return rows


def _ours(model: Qwen3Model, prompts: list[list[int]], max_new: int, use_cache: bool, batch: int) -> list[list[int]]:
    opts = DecodeOptions(max_new_tokens=max_new, stop_ids=(STOP,), pad_id=PAD, use_cache=use_cache)
    rows: list[list[int]] = [[] for _ in prompts]
    for indices, result in generate(model, model.cfg, prompts, opts, batch):
        for i, tokens in zip(indices, result.tokens):
            rows[i] = tokens
    return rows


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "no_cache"])
@pytest.mark.parametrize("batch_size", [1, 3], ids=["batch1", "batched"])
def test_greedy_matches_transformers(models, prompts, expected, use_cache: bool, batch_size: int) -> None:
    assert _ours(models[1], prompts, 10, use_cache, batch_size) == expected
