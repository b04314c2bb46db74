"""Stage grpo's decode step without per-step (B, V) temporaries (``engine.train.grpo_rollout.HeadLogits``, the
sampler's ``scratch``) and with the cache's k/v unexpanded (a one-token step's native GQA): the same logits, the
same tokens and the same attention output as the plain computations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.contract.model_config import ModelConfig
from engine.model.attention import block_causal_mask, core_attention, plan_attention
from engine.model.qwen3 import Qwen3Model
from engine.train.grpo_rollout import HeadLogits
from engine.train.grpo_sampling import Sampling, draw_uniforms, next_tokens

CFG = ModelConfig(1, 32, 64, 4, 2, 8, vocab_size=1000, max_position_embeddings=64, tie_word_embeddings=True)


@pytest.mark.parametrize(
    "s", [Sampling(), Sampling(temperature=0.7), Sampling(top_k=5)], ids=["plain", "temperature", "top_k"]
)
def test_buffered_head_and_scratch_sampling_draw_the_plain_tokens(s: Sampling) -> None:
    torch.manual_seed(0)
    model = Qwen3Model(CFG)
    model.init_weights(0)
    head = HeadLogits()
    u = draw_uniforms([torch.Generator().manual_seed(5)], 6, 3, torch.device("cpu"))
    for step in range(3):  # the buffers are reused: each step's logits are its own
        hidden = torch.randn(6, 2, CFG.hidden_size)
        plain = hidden[:, -1] @ model.output_weight().t()
        logits = head(model, hidden)
        torch.testing.assert_close(logits, plain, rtol=1e-6, atol=1e-6)
        expected = next_tokens(logits.clone(), s, u[step])
        assert torch.equal(next_tokens(logits, s, u[step], scratch=True), expected)
    assert head.rows is not None and head.rows.shape == (6, CFG.vocab_size)


def test_scratch_leaves_the_callers_logits_alone_without_it() -> None:
    logits = torch.randn(4, 300)
    kept = logits.clone()
    next_tokens(logits, Sampling(temperature=0.5), torch.rand(4, dtype=torch.float64))
    assert torch.equal(logits, kept)


def test_a_decode_steps_native_gqa_equals_the_expanded_cache() -> None:
    torch.manual_seed(1)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    plan = plan_attention(torch.device("cpu"), 1, 8, attention_mask=mask)
    assert plan.native_gqa
    q, k, v = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    expanded = F.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=plan.mask, scale=0.25
    ).transpose(1, 2)
    assert torch.equal(core_attention(q, k, v, plan), expanded)


def test_a_packed_masks_additive_form_is_built_once_and_gives_the_boolean_results() -> None:
    torch.manual_seed(2)
    segments = torch.tensor([[0] * 5 + [1] * 7])
    plan = plan_attention(torch.device("cpu"), 12, segment_ids=segments)
    assert plan.mask is not None and plan.mask.dtype == torch.bool
    q, k, v = (torch.randn(1, 4, 12, 8, requires_grad=True) for _ in range(3))
    out = core_attention(q, k, v, plan)
    first = plan.additive
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]
    for t in (q, k, v):
        t.grad = None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(segments), scale=8**-0.5)
    ref.transpose(1, 2).square().sum().backward()
    assert torch.equal(out, ref.transpose(1, 2))
    assert all(t.grad is not None and torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v), strict=True))
    core_attention(q, k, v, plan)  # a second layer of the same forward
    assert plan.additive is first  # one additive mask for every layer
