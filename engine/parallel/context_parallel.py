"""Context parallelism: the CP ranks of a sequence each hold ``T / CP`` of its tokens through every layer; only
attention needs the others'. Three ways, MindSpeed's ``context_parallel_algo``:

- ``ulysses_cp_algo`` (DeepSpeed-Ulysses): around attention an all-to-all swaps the rank's tokens of every head for
  all ``T`` tokens of ``1 / CP`` of the heads (KV groups split the same way, so each rank's query heads keep their own
  groups; KV heads fewer than the degree, or not a multiple of it, are repeated until they split), then back.
  Contiguous token slices.
- ``megatron_cp_algo`` (ring, ``engine.parallel.ring_attention``): queries stay, K/V blocks go round the ranks.
  Head/tail chunks for the causal load balance.
- ``hybrid_cp_algo``: Ulysses inside groups of ``ulysses_degree_in_cp`` neighbouring ranks, a ring across the groups:
  each group holds one ring member's head/tail tokens, split contiguously among its Ulysses ranks.

``shard_index`` is which tokens a CP rank holds (``engine.train.batches.context_shard`` cuts the batch by it).
Applied from outside, like the TP plan: each layer's ``self_attention.attend`` (``engine.model.attention.
core_attention``) is wrapped, and the model plans its attention for ``CP × local`` tokens (the batch carries the
full ``segment_ids``). The all-to-alls are ``torch.distributed.nn.functional.all_to_all_single`` (differentiable;
gloo has it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single

from engine.contract.layout import CpAlgo, kv_repeats
from engine.model.attention import AttentionPlan, attention_inputs, core_attention
from engine.model.lean_ops import mark_rebuildable
from engine.parallel.ring_attention import Ring, ring_attention, token_index


def _to_heads(x: torch.Tensor, group: ProcessGroup, cp: int) -> torch.Tensor:
    """(B, heads, T/CP, d) local tokens of every head -> (B, heads/CP, T, d) every token of this rank's heads. K/V
    heads that do not split over ``cp`` are repeated first (``kv_repeats``; their gradients sum back through
    ``repeat_interleave``), each copy next to its original, so query head i keeps K/V head i // group size.

    Chunks travel token-major, (B, T/CP, heads/CP, d) each, so the received buffer is already (B, T, heads/CP, d)
    when B is 1 (packed rows): the result is a strided view of it, which the attention kernels read as is and save
    for backward, instead of one more copy of every token."""
    if (r := kv_repeats(x.shape[1], cp)) > 1:
        x = x.repeat_interleave(r, dim=1)
    b, h, tl, d = x.shape
    send = (
        x.transpose(1, 2).reshape(b, tl, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    )  # chunk j: rank j's heads
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # chunk j: rank j's tokens of my heads
    return recv.transpose(0, 1).reshape(b, cp * tl, h // cp, d).transpose(1, 2)


def _to_tokens(out: torch.Tensor, group: ProcessGroup, cp: int) -> torch.Tensor:
    """(B, T, heads/CP, d) attention output of this rank's heads -> (B, T/CP, heads, d) of its own tokens.

    The result is marked rebuildable from ``out`` (which the attention kernel saves for its backward): the output
    projection frees it until its backward, which then runs this all-to-all again without autograd. Otherwise a
    rank would keep both, where one process keeps the attention output alone (Megatron's Ulysses keeps both)."""
    tokens = _exchange_to_tokens(out, group, cp, all_to_all_single)
    return mark_rebuildable(tokens, lambda: _exchange_to_tokens(out.detach(), group, cp, _all_to_all_values))


def _exchange_to_tokens(out: torch.Tensor, group: ProcessGroup, cp: int, exchange: _Exchange) -> torch.Tensor:
    b, t, hh, d = out.shape
    send = out.reshape(b, cp, t // cp, hh, d).transpose(0, 1).contiguous()  # chunk j: rank j's tokens
    recv = exchange(torch.empty_like(send), send, group=group)  # chunk j: rank j's heads of my tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, t // cp, cp * hh, d)


class _Exchange(Protocol):
    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor: ...


def _all_to_all_values(output: torch.Tensor, input: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    dist.all_to_all_single(output, input, group=group)
    return output


def shard_index(width: int, ring: int, ulysses: int, rank: int) -> np.ndarray:
    """Positions of a row of ``width`` tokens (a multiple of ``2 × CP`` with a ring, of CP without) that CP rank
    ``rank`` holds, CP = ring × ulysses with the Ulysses ranks of a ring member neighbours."""
    member, part = divmod(rank, ulysses)
    tokens = token_index(width, ring, member) if ring > 1 else np.arange(width)
    n = len(tokens) // ulysses
    return tokens[part * n : (part + 1) * n]


def shard_multiple(ring: int, ulysses: int) -> int:
    """What a row's width is padded to a multiple of, so that every CP rank gets the same number of tokens."""
    return 2 * ring * ulysses if ring > 1 else ulysses


class UlyssesAttention:
    """``core_attention`` over the whole sequence for a ``1 / CP`` share of the heads (see the module docstring)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group, self.cp = mesh.get_group(), mesh.size()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        q, k, v = (_to_heads(x, self.group, self.cp) for x in (q, k, v))
        return _to_tokens(core_attention(q, k, v, plan), self.group, self.cp)


class RingAttention:
    """Ring attention over ``mesh``; with ``ulysses`` (hybrid) each ring member is that group's all-to-all of heads."""

    def __init__(self, mesh: DeviceMesh, overlap: bool, ulysses: DeviceMesh | None = None) -> None:
        self.ring = Ring(mesh.get_group(), mesh.size(), mesh.get_local_rank(), overlap)
        self.ulysses = None if ulysses is None else (ulysses.get_group(), ulysses.size())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        if self.ulysses is not None:
            q, k, v = (_to_heads(x, *self.ulysses) for x in (q, k, v))
        q, k, v = attention_inputs(q, k, v)  # one dtype: what the ring saves is bf16 under bf16 autocast
        out = ring_attention(q, k, v, self.ring, plan.runs).transpose(1, 2)  # (B, T, heads, d)
        return out if self.ulysses is None else _to_tokens(out, *self.ulysses)


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, algo: CpAlgo, overlap: bool = True) -> nn.Module:
    """Wrap every layer's attention of ``model`` (a ``DecoderLM``) for ``algo`` over ``mesh``'s CP dimensions
    (``cp``; ``cp_ring`` × ``cp_ulysses`` for hybrid, as ``engine.parallel.mesh.build_mesh`` names them); in place."""
    from engine.model.decoder_lm import decoder_lm
    from engine.model.moe import moe_layers
    from engine.model.qwen3 import SelfAttention

    lm = decoder_lm(model)
    attend: UlyssesAttention | RingAttention
    if algo == "ulysses_cp_algo":
        attend = UlyssesAttention(mesh["cp"])
    elif algo == "megatron_cp_algo":
        attend = RingAttention(mesh["cp"], overlap)
    else:
        attend = RingAttention(mesh["cp_ring"], overlap, mesh["cp_ulysses"])
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.attend = attend
    lm.context_parallel = mesh["cp"].size()
    lm.context_group = mesh["cp"].get_group()
    for layer in moe_layers(model).values():  # routing counts completed over the sequence's ranks
        layer.context_group = lm.context_group
    lm.ring_attention = algo != "ulysses_cp_algo"
    return model


@contextlib.contextmanager
def whole_sequences(model: nn.Module) -> Iterator[None]:
    """``model``'s forwards run on whole sequences for a while, as without context parallelism: every CP rank gives
    the same tokens and keeps them all (stage grpo's decoding: each CP rank decodes its DP group's rows whole, its KV
    cache holding every position, as TP ranks do), then the wrapping ``apply_context_parallel`` made is restored. A
    no-op on a model without it."""
    from engine.model.decoder_lm import decoder_lm
    from engine.model.moe import moe_layers
    from engine.model.qwen3 import SelfAttention

    lm = decoder_lm(model)
    if lm.context_parallel == 1:
        yield
        return
    attends = {m: m.attend for m in model.modules() if isinstance(m, SelfAttention)}
    routers = moe_layers(model)
    kept = (lm.context_parallel, lm.ring_attention, {i: layer.context_group for i, layer in routers.items()})
    for module in attends:
        module.attend = core_attention
    lm.context_parallel, lm.ring_attention = 1, False
    for layer in routers.values():  # the rows are the same on every CP rank: routing counts are this rank's own
        layer.context_group = None
    try:
        yield
    finally:
        for module, attend in attends.items():
            module.attend = attend
        lm.context_parallel, lm.ring_attention = kept[0], kept[1]
        for i, layer in routers.items():
            layer.context_group = kept[2][i]
