"""Incremental decoding with KVCache gives the logits of a full forward (batch 1 and left-padded batches)."""

from __future__ import annotations

import pytest
import torch

from engine.contract.model_config import ModelConfig
from engine.model.kv_cache import KVCache
from engine.model.qwen3 import Qwen3Model

VOCAB = 300


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    cfg = ModelConfig(2, 48, 96, 4, 2, 16, vocab_size=VOCAB, tie_word_embeddings=True)
    m = Qwen3Model(cfg)
    m.init_weights(seed=0)
    with torch.no_grad():  # larger weights than Megatron init, so attention patterns actually differ per position
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8)
    return m.eval()


@torch.no_grad()
def test_incremental_decoding_matches_full_forward(model: Qwen3Model) -> None:
    ids = torch.randint(0, VOCAB, (1, 12))
    full = model(ids)
    cache = KVCache(model.cfg, batch_size=1, max_len=16)
    steps = [model(ids[:, :5], kv_cache=cache)]  # prefill
    steps += [model(ids[:, t : t + 1], kv_cache=cache) for t in range(5, 10)]  # one token at a time
    steps.append(model(ids[:, 10:], kv_cache=cache))  # several new tokens on top of a cache
    assert cache.length == 12
    assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5


@torch.no_grad()
def test_left_padded_batch_decodes_like_each_sample_alone(model: Qwen3Model) -> None:
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (7, 3, 5)]
    new_tokens = torch.randint(0, VOCAB, (3, 4))  # forced continuations (teacher forcing)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1
    cache = KVCache(model.cfg, batch_size=3, max_len=width + 4)
    last = [model(ids, attention_mask=mask, kv_cache=cache)[:, -1]]
    for t in range(3):
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        last.append(model(new_tokens[:, t : t + 1], attention_mask=mask, kv_cache=cache)[:, -1])
    got = torch.stack(last, dim=1)  # (3, 4, V): logits after the prompt and after each forced token
    for row, p in enumerate(prompts):
        alone = model(torch.cat([p, new_tokens[row, :3]])[None])[0, len(p) - 1 :]
        assert (got[row] - alone).abs().max().item() <= 1e-5, row


def test_cache_refuses_overflow_and_mismatched_mask(model: Qwen3Model) -> None:
    cache = KVCache(model.cfg, batch_size=1, max_len=4)
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
    cache.reset()
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 2), kv_cache=cache)


def test_cache_shapes_follow_local_kv_heads() -> None:
    cfg = ModelConfig(4, 32, 64, 4, 2, 8, vocab_size=64)
    cache = KVCache(cfg, batch_size=2, max_len=10, num_kv_heads=1, layers=[2, 3])
    k, v = cache.update(3, torch.ones(2, 1, 4, 8), torch.ones(2, 1, 4, 8))
    assert k.shape == v.shape == (2, 1, 4, 8)
    assert cache.length == 4
    cache.crop(2)
    assert cache.length == 2
