"""Activation checkpointing of decoder layers, with Megatron's knobs.

- ``full``: recompute whole decoder layers in backward. ``recompute_method``: ``block`` recomputes the first
  ``recompute_num_layers`` layers and keeps the rest; ``uniform`` (and no method) recomputes every layer
  (Megatron's uniform groups ``recompute_num_layers`` layers per checkpoint; per-layer checkpoints store the same
  boundaries or fewer, so memory is the same or lower).
- ``selective``: Megatron recomputes core attention only; here an op-level policy (torchtitan SelectiveAC style)
  keeps every matmul output (and the expert-parallel all-to-all's) and recomputes the cheap rest (attention softmax,
  norms, RoPE, SwiGLU), which is the same trade: save the FLOP-heavy results, recompute what is memory-heavy and
  cheap.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from engine.model.decoder_lm import decoder_lm
from engine.model.moe import GroupedExperts
from engine.model.qwen3 import MLP, SelfAttention
from engine.torch_compat import ALL_TO_ALL_OP, PROFILER_MARKER_OPS, checkpoint_wrapper

# Outputs of these ops are kept in selective mode; everything else is recomputed.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._grouped_mm.default,  # the MoE experts' matmuls on accelerators (engine.model.moe)
    ALL_TO_ALL_OP,  # expert parallelism's token exchange: kept, not sent again in the recompute (torchtitan too)
}


def _selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _layers_to_wrap(num_layers: int, method: str | None, recompute_num_layers: int | None) -> list[int]:
    if method == "block":
        return list(range(min(recompute_num_layers or num_layers, num_layers)))
    return list(range(num_layers))


def apply_ac(
    model: nn.Module, granularity: str, method: str | None = None, recompute_num_layers: int | None = None
) -> list[int]:
    """Wrap ``model.decoder.layers`` in place; returns the indices (in layer order) that recompute."""
    layers = decoder_lm(model).decoder.layers
    keys = list(layers.keys())
    chosen = _layers_to_wrap(len(keys), method if granularity == "full" else None, recompute_num_layers)
    if granularity == "selective":
        # Profiler markers carry no data, but FSDP's hooks emit more of them in a recompute than in the forward when
        # an FSDP group sits inside the checkpointed layer (expert parallelism's experts: its root pre-forward runs
        # again), and selective checkpointing counts every op; its public ignore list takes them.
        SAC_IGNORED_OPS.update(PROFILER_MARKER_OPS)
    for i in chosen:
        for module in layers[keys[i]].modules():
            if isinstance(module, (MLP, GroupedExperts)):
                module.free_activation = False  # the checkpoint frees the SwiGLU product already
            if isinstance(module, SelfAttention):
                module.free_attention_output = False  # nor a context-parallel attention output
        if granularity == "selective":
            context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            wrapped = checkpoint_wrapper(layers[keys[i]], context_fn=context_fn, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(layers[keys[i]], preserve_rng_state=False)
        layers[keys[i]] = wrapped
    return chosen
