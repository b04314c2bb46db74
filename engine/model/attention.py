"""Core attention (softmax(q k^T / sqrt(d)) v) for causal, packed (segment_ids) and left-padded batches.

The caller builds one ``AttentionPlan`` per forward (``plan_attention``) and every layer reuses it:
- plain causal batch: ``scaled_dot_product_attention(is_causal=True)`` — flash kernel on CUDA, no mask tensor;
- packed samples (segment_ids): on NPU ``torch_npu.npu_fusion_attention`` in TND layout with cumulative sequence
  lengths, on CUDA torch's own flash varlen kernel (``torch.nn.attention.varlen.varlen_attn``) or else
  ``flash_attn_varlen_func`` when flash-attn is installed; otherwise SDPA with ONE boolean block mask
  (B, 1, T, T) built once per batch (1 byte per entry, shared by all layers and heads — never a float mask per head);
- left padding and/or a KV cache: SDPA with a boolean (B, 1, T, T_kv) mask (or the serving cache's own, given
  whole as a 4-D ``attention_mask``).
The kernel choice comes from ``engine.model.kernels.attention_kernel``; head counts are read from tensor shapes, so
a TP shard holding fewer heads works unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from engine.model.kernels import AttentionKernel, attention_kernel


@dataclasses.dataclass
class AttentionPlan:
    """What every layer needs to run attention for one batch."""

    kernel: AttentionKernel = "sdpa"
    mask: torch.Tensor | None = None  # (B, 1, T, T_kv) bool, True = may attend; None with is_causal
    is_causal: bool = True
    cu_seqlens: torch.Tensor | None = None  # (n_docs + 1,) int32 over the flattened B*T tokens, varlen kernels only
    max_seqlen: int = 0
    seq_ends: list[int] | None = None  # cu_seqlens[1:] on the host (NPU kernel argument), read once per batch
    # (B, T) packed-sample index of every token: ring context parallelism masks each K/V block from it (no T × T)
    runs: torch.Tensor | None = None
    # (T,) or (B, T) bool, the tokens MoE routing figures count, and how many of the batch: set (``Qwen3Model``) only
    # when context parallelism padded the rows itself, so that padding weighs nothing one process would not route
    counted: torch.Tensor | None = None
    counted_tokens: int = 0
    # serving's 4-D cache mask and a one-token decode step: on CPU, SDPA takes GQA with the mask directly (4x faster
    # than expanding k/v at 32 decode rows); training and prefill keep the expansion, whose float order the layout
    # and reference tests are pinned to
    native_gqa: bool = False
    # ``mask`` as SDPA's CPU kernel takes it (additive, in the queries' dtype), converted once for every layer
    additive: torch.Tensor | None = None

    def sdpa_mask(self, q: torch.Tensor) -> torch.Tensor | None:
        """The mask given to SDPA. On CPU a boolean mask is converted here, once per plan, to the additive mask SDPA
        would convert it to (0 / -inf, the same numbers): SDPA's CPU kernel saves its own converted copy for backward
        in every layer, a (B, 1, T, T_kv) fp32 tensor each (16 MB at 2,040 packed tokens), where all layers can share
        one."""
        if self.mask is None or self.mask.dtype != torch.bool or q.device.type != "cpu":
            return self.mask
        if self.additive is None or self.additive.dtype != q.dtype:
            self.additive = torch.zeros(self.mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~self.mask, float("-inf")
            )
        return self.additive


def segment_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True where a new sample starts (each row start, and wherever the segment id changes)."""
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return starts


def cu_seqlens_from_segments(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sample lengths over the row-major flattened batch, and the longest sample (a host sync)."""
    starts = segment_starts(segment_ids).flatten().nonzero().flatten()
    total = torch.tensor([segment_ids.numel()], device=starts.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: token i sees token j iff j <= i and both lie in the same run of equal segment ids
    (runs, not ids, so that this path and the varlen kernels' cumulative lengths agree on any input)."""
    t = segment_ids.shape[1]
    runs = segment_starts(segment_ids).cumsum(dim=1)  # (B, T) run index per token
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    same = runs[:, :, None] == runs[:, None, :]  # (B, T, T)
    return (same & causal)[:, None]


def padded_causal_mask(attention_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """(B, 1, q_len, T_kv) bool for the last ``q_len`` query positions of a left-padded (B, T_kv) 1/0 mask.

    A padded query row would otherwise see no key at all and SDPA would return NaN; it may see itself (its output
    is never used, and the diagonal keeps the softmax finite).
    """
    kv_len = attention_mask.shape[1]
    q_pos = torch.arange(kv_len - q_len, kv_len, device=attention_mask.device)[:, None]  # (q_len, 1)
    k_pos = torch.arange(kv_len, device=attention_mask.device)[None, :]  # (1, T_kv)
    allowed = (k_pos <= q_pos) & attention_mask.bool()[:, None, :]  # (B, q_len, T_kv)
    return (allowed | (k_pos == q_pos))[:, None]


def plan_attention(
    device: torch.device,
    q_len: int,
    past_len: int = 0,
    segment_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    batch: int = 1,
    runs_only: bool = False,
) -> AttentionPlan:
    """Choose kernel and masks once per forward; ``runs_only`` (ring context parallelism, causal training rows):
    no mask and no kernel, only the packed samples' run index."""
    if segment_ids is not None and (attention_mask is not None or past_len):
        raise ValueError("segment_ids: packed batches cannot be combined with attention_mask or a KV cache")
    if runs_only:
        if attention_mask is not None or past_len:
            raise ValueError("attention_mask: ring context parallelism takes causal training rows only")
        starts = None if segment_ids is None else segment_starts(segment_ids)
        # one sample per row (a host read): no run index, so the ring's blocks need no masks
        runs = starts.cumsum(dim=1) if starts is not None and starts[:, 1:].any() else None
        return AttentionPlan(is_causal=runs is None, runs=runs)
    if (
        segment_ids is None
        and attention_mask is None
        and not past_len
        and attention_kernel(device.type) == "npu_fusion"
    ):
        # On NPU the fused kernel is also the fast path for plain causal rows: one sample per row.
        segment_ids = torch.zeros(batch, q_len, dtype=torch.long, device=device)
    if segment_ids is not None:
        kernel = attention_kernel(device.type)
        if kernel == "sdpa":
            if not segment_starts(segment_ids)[:, 1:].any():  # one sample per row (a host read): no T × T mask
                return AttentionPlan()
            return AttentionPlan(mask=block_causal_mask(segment_ids), is_causal=False)
        cu, longest = cu_seqlens_from_segments(segment_ids)
        ends = cu[1:].tolist() if kernel == "npu_fusion" else None
        return AttentionPlan(kernel=kernel, is_causal=False, cu_seqlens=cu, max_seqlen=longest, seq_ends=ends)
    if attention_mask is not None and attention_mask.dim() == 4:
        # serving (engine.serve.slots): the caller's (B, 1, T, T_kv) boolean mask, rows at their own lengths
        return AttentionPlan(mask=attention_mask, is_causal=False, native_gqa=True)
    if attention_mask is not None:
        if attention_mask.shape[1] != past_len + q_len:
            raise ValueError(
                f"attention_mask: has {attention_mask.shape[1]} columns, expected cache length + new tokens "
                f"= {past_len} + {q_len}"
            )
        # one new token (a decode step): SDPA's GQA without expanding the cache's k/v (bitwise the same output on
        # CPU, 4x faster at 16 rows); longer queries keep the expansion the layout tests' float order is pinned to
        return AttentionPlan(mask=padded_causal_mask(attention_mask, q_len), is_causal=False, native_gqa=q_len == 1)
    if past_len:
        # One new token attends to everything cached; several new tokens need the offset causal mask.
        if q_len == 1:
            return AttentionPlan(is_causal=False)
        ones = torch.ones(1, past_len + q_len, dtype=torch.long, device=device)
        return AttentionPlan(mask=padded_causal_mask(ones, q_len), is_causal=False)
    return AttentionPlan()


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """q (B, nh, T, d), k/v (B, nkv, T_kv, d) -> (B, T, nh, d). GQA: query head h uses kv head h // (nh/nkv)."""
    if plan.kernel != "sdpa" or not q.dtype == k.dtype == v.dtype:
        q, k, v = attention_inputs(q, k, v)
    if plan.kernel != "sdpa":
        return _VARLEN[plan.kernel](q, k, v, plan)
    gqa = k.shape[1] != q.shape[1]
    if gqa and plan.mask is not None and not (plan.native_gqa and q.device.type == "cpu"):
        # With a mask, CUDA's memory-efficient kernel is the one that applies; SDPA's docstring says GQA works only
        # with the flash and math kernels, and math materialises (B, nh, T, T) scores. So expand k/v instead.
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, nh, T_kv, d)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=plan.sdpa_mask(q),
        is_causal=plan.is_causal,
        scale=q.shape[-1] ** -0.5,
        enable_gqa=gqa,
    )  # (B, nh, T, d); SDPA's softmax accumulates in fp32 for bf16 inputs
    return out.transpose(1, 2)


def attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One dtype for the attention kernels (and the ring's blocks). Under autocast q/k leave the fp32-weighted q/k RMSNorm in fp32 while v
    is bf16; the varlen kernels need one dtype, and casting here does not rely on SDPA being on autocast's list."""
    kind = q.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else v.dtype
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _to_tnd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])  # (B, n, T, d) -> (B*T, n, d)


_VarlenInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]


def _varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> _VarlenInputs:
    """The positional arguments both varlen kernels take: packed (B*T, n, d) q/k/v, then the same sequence bounds
    and longest length for queries and keys (self-attention)."""
    assert plan.cu_seqlens is not None  # attention_plan sets it for the varlen kernels
    bounds = (plan.cu_seqlens, plan.cu_seqlens, plan.max_seqlen, plan.max_seqlen)
    return (_to_tnd(q), _to_tnd(k), _to_tnd(v), *bounds)


def _torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn  # present: attention_kernel checked

    b, nh, t, d = q.shape
    out = varlen_attn(
        *_varlen_inputs(q, k, v, plan),
        scale=d**-0.5,
        window_size=(-1, 0),
        enable_gqa=k.shape[1] != nh,  # (-1, 0) = causal
    )  # (B*T, nh, d)
    assert isinstance(out, torch.Tensor)  # return_aux=False: the output alone
    return out.view(b, t, nh, d)


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func  # present: attention_kernel checked

    b, nh, t, d = q.shape
    out = flash_attn_varlen_func(
        *_varlen_inputs(q, k, v, plan),
        softmax_scale=d**-0.5,
        causal=True,
    )  # (B*T, nh, d)
    return out.view(b, t, nh, d)


_NPU_CAUSAL_MASK: dict[torch.device, torch.Tensor] = {}


def _npu_fusion(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    import torch_npu  # present: attention_kernel checked

    b, nh, t, d = q.shape
    # sparse_mode 3 (right-down causal) wants the fixed 2048x2048 upper-triangular mask, True = masked out.
    mask = _NPU_CAUSAL_MASK.get(q.device)
    if mask is None:
        mask = torch.ones(2048, 2048, dtype=torch.bool, device=q.device).triu(1)
        _NPU_CAUSAL_MASK[q.device] = mask
    # the kernel takes cumulative lengths without the leading 0, as a host list
    out = torch_npu.npu_fusion_attention(
        _to_tnd(q),
        _to_tnd(k),
        _to_tnd(v),
        nh,
        "TND",
        atten_mask=mask,
        scale=1.0 / math.sqrt(d),
        actual_seq_qlen=plan.seq_ends,
        actual_seq_kvlen=plan.seq_ends,
        sparse_mode=3,
    )[0]  # (B*T, nh, d)
    return out.view(b, t, nh, d)


_VARLEN = {"torch_varlen": _torch_varlen, "flash_varlen": _flash_varlen, "npu_fusion": _npu_fusion}
