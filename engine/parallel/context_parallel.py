"""Context parallelism, Ulysses style (DeepSpeed-Ulysses; MindSpeed's ``ulysses_cp_algo``): each of the CP ranks of
a sequence holds ``T / CP`` of its tokens through every layer, and around attention an all-to-all swaps that for
all ``T`` tokens of ``1 / CP`` of the heads (KV groups split the same way, so each rank's query heads keep their own
groups), then back. Everything else in a layer is per token, so it runs on the local slice unchanged.

Applied from outside, like the TP plan: each layer's ``self_attention.attend`` (``engine.model.attention.
core_attention``) is wrapped, and the model plans its attention mask for ``CP × local`` tokens (the batch carries the
full ``segment_ids``; ``engine.train.batches.context_shard`` cuts the rest). The all-to-alls are
``torch.distributed.nn.functional.all_to_all_single`` (differentiable; gloo has it).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single

from engine.model.attention import AttentionPlan, core_attention


def _to_heads(x: torch.Tensor, group: ProcessGroup, cp: int) -> torch.Tensor:
    """(B, heads, T/CP, d) local tokens of every head -> (B, heads/CP, T, d) every token of this rank's heads."""
    b, h, tl, d = x.shape
    send = x.reshape(b, cp, h // cp, tl, d).transpose(0, 1).contiguous()  # chunk j: the heads rank j keeps
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # chunk j: rank j's tokens of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * tl, d)


def _to_tokens(out: torch.Tensor, group: ProcessGroup, cp: int) -> torch.Tensor:
    """(B, T, heads/CP, d) attention output of this rank's heads -> (B, T/CP, heads, d) of its own tokens."""
    b, t, hh, d = out.shape
    send = out.reshape(b, cp, t // cp, hh, d).transpose(0, 1).contiguous()  # chunk j: rank j's tokens
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # chunk j: rank j's heads of my tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, t // cp, cp * hh, d)


class UlyssesAttention:
    """``core_attention`` over the whole sequence for a ``1 / CP`` share of the heads (see the module docstring)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group, self.cp = mesh.get_group(), mesh.size()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        q, k, v = (_to_heads(x, self.group, self.cp) for x in (q, k, v))
        return _to_tokens(core_attention(q, k, v, plan), self.group, self.cp)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Wrap every layer's attention of ``model`` (a ``Qwen3Model``) for Ulysses over ``cp_mesh``; in place."""
    from engine.model.qwen3 import Qwen3Model, SelfAttention

    qwen = cast(Qwen3Model, model)
    attend = UlyssesAttention(cp_mesh)
    for module in qwen.modules():
        if isinstance(module, SelfAttention):
            module.attend = attend
    qwen.context_parallel = cp_mesh.size()
    return model
