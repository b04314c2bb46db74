"""Attention plans: masks, cumulative sequence lengths and the varlen-kernel plumbing (layouts, not kernels).

The varlen kernels need CUDA/NPU; here they are replaced by a reference written with SDPA per sample, which checks
our TND layout, cumulative lengths and arguments, not the kernels' numerics."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import varlen

from engine.contract.model_config import ModelConfig
from engine.model import attention
from engine.model.attention import block_causal_mask, cu_seqlens_from_segments, padded_causal_mask, plan_attention
from engine.model.qwen3 import Qwen3Model


def test_cu_seqlens_over_flattened_rows() -> None:
    seg = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 2]])  # row 2 restarts even with the same id as row 1's end
    cu, longest = cu_seqlens_from_segments(seg)
    assert cu.tolist() == [0, 2, 5, 9, 10] and cu.dtype == torch.int32 and longest == 4


def test_masks() -> None:
    m = block_causal_mask(torch.tensor([[0, 0, 1]]))[0, 0]
    assert m.tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    m = block_causal_mask(torch.tensor([[5, 7, 5]]))[0, 0]  # a reused id starts a new sample, as in cu_seqlens
    assert m.tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    pad = padded_causal_mask(torch.tensor([[0, 1, 1]]), q_len=3)[0, 0]
    # the padded row sees only itself (keeps softmax finite), real rows never see the pad column
    assert pad.tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    assert plan_attention(torch.device("cpu"), 8).is_causal  # plain batch: no mask tensor at all
    with pytest.raises(ValueError, match="segment_ids"):
        plan_attention(torch.device("cpu"), 4, past_len=2, segment_ids=torch.zeros(1, 4))


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """flash_attn_varlen_func's contract written with SDPA per sample (TND in, TND out; GQA by head grouping)."""
    assert causal and torch.equal(cu_q, cu_k)
    assert q.dtype == k.dtype == v.dtype  # fused kernels take one dtype
    out = torch.empty_like(q)
    bounds = cu_q.tolist()
    for s, e in itertools.pairwise(bounds):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))  # (n, len, d)
        out[s:e] = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=softmax_scale, enable_gqa=True
        ).transpose(0, 1)
    return out


def _reference_torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    assert window_size == (-1, 0) and enable_gqa == (k.shape[1] != q.shape[1])
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)


@pytest.mark.parametrize("kernel", ["flash_varlen", "torch_varlen"])
def test_varlen_paths_lay_out_tokens_like_the_block_mask(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig(2, 32, 64, 4, 2, 8, vocab_size=128)
    model = Qwen3Model(cfg)
    model.init_weights(seed=0)
    ids = torch.randint(0, 128, (2, 9))
    seg = torch.tensor([[0] * 4 + [1] * 5, [0] * 6 + [1] * 3])
    pos = torch.cat([torch.arange(4), torch.arange(5)]).expand(2, 9)
    pos = torch.stack([pos[0], torch.cat([torch.arange(6), torch.arange(3)])])
    with torch.no_grad():
        expected = model(ids, position_ids=pos, segment_ids=seg)
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=_reference_varlen))
        monkeypatch.setattr(varlen, "varlen_attn", _reference_torch_varlen)
        monkeypatch.setattr(attention, "attention_kernel", lambda device_type: kernel)
        assert plan_attention(ids.device, 9, segment_ids=seg).kernel == kernel
        got = model(ids, position_ids=pos, segment_ids=seg)
    assert (got - expected).abs().max().item() <= 1e-5


def test_varlen_inputs_share_the_autocast_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 autocast q/k leave the fp32 q/k norms in fp32 while v is bf16; the kernel must get one dtype."""
    model = Qwen3Model(ModelConfig(1, 32, 64, 4, 2, 8, vocab_size=64))
    model.init_weights(seed=0)
    seen = []

    def spy(q, k, v, *args, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return _reference_torch_varlen(q, k, v, *args, **kw)

    monkeypatch.setattr(varlen, "varlen_attn", spy)
    monkeypatch.setattr(attention, "attention_kernel", lambda device_type: "torch_varlen")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 64, (1, 6)), segment_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]))
    assert seen == [(torch.bfloat16,) * 3]


def test_plain_batches_use_the_npu_kernel_as_one_sample_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "attention_kernel", lambda device_type: "npu_fusion")
    plan = plan_attention(torch.device("cpu"), 5, batch=3)
    assert plan.kernel == "npu_fusion" and plan.seq_ends == [5, 10, 15] and plan.max_seqlen == 5
    assert plan_attention(torch.device("cpu"), 1, past_len=4).kernel == "sdpa"  # decoding stays on SDPA


def test_packed_rows_of_one_sample_each_need_no_mask() -> None:
    """SDPA: rows that each hold one sample (a long sample per row, padding joined to it) are plain causal, without
    the (B, 1, T, T) block mask: at 32K tokens that mask alone is 1 GiB per row."""
    one = torch.tensor([[0, 0, 0, 0], [5, 5, 5, 5]])
    plan = plan_attention(torch.device("cpu"), 4, segment_ids=one, batch=2)
    assert plan.mask is None and plan.is_causal
    two = torch.tensor([[0, 0, 1, 1], [5, 5, 5, 5]])
    plan = plan_attention(torch.device("cpu"), 4, segment_ids=two, batch=2)
    assert plan.mask is not None and not plan.is_causal and torch.equal(plan.mask, block_causal_mask(two))
    q, k, v = (torch.randn(2, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    masked = attention.core_attention(q, k, v, attention.AttentionPlan(mask=block_causal_mask(one), is_causal=False))
    assert torch.allclose(attention.core_attention(q, k, v, plan_attention(q.device, 4, segment_ids=one)), masked)


@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=3).filter(
        lambda rows: len({len(r) for r in rows}) == 1
    )
)
@settings(max_examples=40, deadline=None)
def test_block_mask_and_cu_seqlens_describe_the_same_samples(rows: list[list[int]]) -> None:
    seg = torch.tensor(rows)
    b, t = seg.shape
    cu, longest = cu_seqlens_from_segments(seg)
    sample = torch.zeros(b * t, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sample[s:e] = i
    sample = sample.view(b, t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    expected = (sample[:, :, None] == sample[:, None, :]) & causal
    assert torch.equal(block_causal_mask(seg)[:, 0], expected)
    assert longest == int((cu[1:] - cu[:-1]).max()) and cu[-1].item() == b * t
