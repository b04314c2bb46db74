"""Our greedy decoding equals ``transformers``' ``generate`` token for token on the same weights and prompts:
with and without the KV cache, batch 1 and batched with left padding, stopping on a stop token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from engine.contract.model_config import preset
from engine.eval.generate import DecodeOptions, generate, generate_batch
from engine.model.hf_mapping import native_from_hf
from engine.model.qwen3 import Qwen3Model

PAD, IM_END = 151643, 151645
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": "请你判读用户的意图。交互历史：用户：广州塔为什么也叫小蛮腰\n用户最后一句话所属的技能和意图是：",
        },
    ],
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "Play some jazz in the kitchen, please."}],
]


@pytest.fixture(scope="module")
def models() -> tuple[Qwen3ForCausalLM, Qwen3Model]:
    cfg = preset("qwen3-tiny")
    torch.manual_seed(0)
    # A wider init than 0.02 gives the random model clear argmax margins, so fp32 rounding order cannot flip a token.
    hf = Qwen3ForCausalLM(Qwen3Config(**{**cfg.to_hf("float32"), "initializer_range": 0.5})).eval()
    ours = Qwen3Model(cfg)
    hf_state = hf.state_dict()
    ours.load_state_dict(dict(native_from_hf(hf_state.__getitem__, cfg)), strict=True)
    return hf, ours.eval()


@pytest.fixture(scope="module")
def prompts(qwen_tokenizer_dir: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    return [
        tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=False) for c in CONVERSATIONS
    ]


@pytest.fixture(scope="module")
def expected(models, prompts) -> list[list[int]]:
    """transformers' 12-token greedy rows (stopped on IM_END or PAD), computed once: every test compares with it."""
    return _hf_generate(models[0], prompts, 12, [IM_END, PAD])


def _hf_generate(
    hf: Qwen3ForCausalLM, prompts: list[list[int]], max_new: int, stop: list[int], use_cache: bool = True
) -> list[list[int]]:
    """transformers' greedy output per prompt, cut before the first stop token."""
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=PAD,
            use_cache=use_cache,
        )
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop), len(row))
        rows.append(row[:cut])
    return rows


def _ours(
    model: Qwen3Model, prompts: list[list[int]], max_new: int, stop: list[int], use_cache: bool, batch_size: int
) -> list[list[int]]:
    opts = DecodeOptions(max_new_tokens=max_new, stop_ids=tuple(stop), pad_id=PAD, use_cache=use_cache)
    rows: list[list[int]] = [[] for _ in prompts]
    for indices, gen in generate(model, model.cfg, prompts, opts, batch_size):
        for i, tokens in zip(indices, gen.tokens):
            rows[i] = tokens
    return rows


# batched-kv_cache: the left-padded cache; batched-no_cache: left padding in a full forward (its longest row unpadded);
# batch1-kv_cache: the one-row path. Batch 1 without the cache (the costliest, a full forward per row and token)
# joins two paths these already cover.
@pytest.mark.parametrize(
    ("use_cache", "batch_size"),
    [(True, 3), (False, 3), (True, 1)],
    ids=["batched-kv_cache", "batched-no_cache", "batch1-kv_cache"],
)
def test_greedy_matches_transformers(models, prompts, expected, use_cache: bool, batch_size: int) -> None:
    _, ours = models
    assert len({len(p) for p in prompts}) == 3  # batched run really is left-padded
    assert _ours(ours, prompts, 12, [IM_END, PAD], use_cache, batch_size) == expected


def test_stop_token_ends_each_row_at_its_own_step(models, prompts, expected) -> None:
    hf, ours = models
    # Make a token the model really produces a stop token, so rows stop at different steps while others go on
    # (greedy rows are prefixes of one another, so the 12-token run's fourth token is the 10-token run's).
    stop = [IM_END, expected[0][3]]
    cut = _hf_generate(hf, prompts, 10, stop)
    assert len(cut[0]) == 3 and any(len(r) > 3 for r in cut)
    opts = DecodeOptions(max_new_tokens=10, stop_ids=tuple(stop), pad_id=PAD)
    gen = generate_batch(ours, ours.cfg, prompts, opts)
    assert gen.tokens == cut
    assert gen.finish_reasons[0] == "stop"
    assert gen.num_generated == sum(len(r) + (reason == "stop") for r, reason in zip(gen.tokens, gen.finish_reasons))


def test_hf_cache_free_generation_agrees_too(models, prompts, expected) -> None:
    """The reference itself is consistent (so a cache bug on our side cannot hide behind one on theirs)."""
    hf, _ = models
    # greedy rows are prefixes of one another: 6 tokens without the cache are the cached 12 tokens' first 6
    assert _hf_generate(hf, prompts, 6, [IM_END, PAD], use_cache=False) == [row[:6] for row in expected]
