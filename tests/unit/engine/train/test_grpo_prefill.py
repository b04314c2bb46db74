"""Stage grpo's decode prefills each group's shared prompt once (``KVCache.repeat_rows``): the cache it hands the
rows, and the completions sampled, equal a prefill of every row."""

from __future__ import annotations

import torch

from engine.contract.model_config import ModelConfig
from engine.model.kv_cache import KVCache
from engine.model.qwen3 import Qwen3Model
from engine.train.grpo_rollout import DecodeOptions, decode
from engine.train.grpo_sampling import Sampling

CFG = ModelConfig(2, 32, 64, 4, 2, 8, vocab_size=300, max_position_embeddings=64)


def test_repeat_rows_copies_each_row_and_its_fill() -> None:
    small = KVCache(CFG, 2, 5)
    for layer in range(CFG.num_layers):
        small.update(layer, torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    big = small.repeat_rows(3, 9)
    assert big.length == 3 and big.max_len == 9 and big.keys[0].shape == (6, 2, 9, 8)
    for layer in range(CFG.num_layers):
        for row in range(6):
            assert torch.equal(big.keys[layer][row, :, :3], small.keys[layer][row // 3, :, :3])
            assert torch.equal(big.values[layer][row, :, :3], small.values[layer][row // 3, :, :3])
        assert not big.keys[layer][:, :, 3:].any()


def _decode(model: Qwen3Model, prompts: list[list[int]], share: bool) -> list[list[int]]:
    opts = DecodeOptions(6, frozenset({299}), 0, Sampling(temperature=0.8), 3, share_prompts=share)
    gens = [torch.Generator().manual_seed(7 + g) for g in range(len(prompts) // 3)]
    return decode(model, CFG, prompts, opts, gens).completions


def test_a_shared_prompt_prefilled_once_samples_what_every_row_prefilled_does() -> None:
    torch.manual_seed(0)
    model = Qwen3Model(CFG).eval()
    prompts = [[5, 6, 7, 8]] * 3 + [[9, 10]] * 3  # two groups of 3, the second left-padded to 4
    shared = _decode(model, prompts, share=True)
    assert shared == _decode(model, prompts, share=False)
    assert len({tuple(c) for c in shared}) > 1  # sampled apart after the shared prefill
