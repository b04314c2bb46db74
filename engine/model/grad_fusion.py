"""Gradient accumulation fusion for the output head (Megatron's ``--gradient-accumulation-fusion`` idea): the head's
weight gradient is added into ``weight.grad`` in its own backward instead of being returned to autograd.

Why: Qwen3's vocabulary makes it a 151,936 × hidden buffer. Returned, it waits in autograd's input buffer through the
whole backward of the layers when the embedding is tied (autograd sums the two uses of the weight before adding to
``.grad``), beside every layer's backward peak (311 MB at hidden 512 in fp32). Added at once, it is gone before the
first layer's backward. Only a plain leaf parameter that trains is fused; a DTensor (TP's vocab-parallel shards) or
a frozen weight goes the usual way. FSDP2 reads the unsharded parameter's ``.grad`` after the module's backward,
which is where the fused gradient is. (The embedding's own gradient is left to autograd: fusing it changes the order
in which repeated tokens' rows are summed, and its buffer appears only at the very end of backward.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def fusable(weight: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether ``weight``'s gradient may be added straight into its ``.grad`` (only if it is ``dtype``, if given)."""
    return (
        isinstance(weight, nn.Parameter)
        and weight.requires_grad
        and not isinstance(weight, DTensor)
        and (dtype is None or weight.dtype == dtype)
        and torch.is_grad_enabled()
    )


def grad_of(weight: torch.Tensor) -> torch.Tensor:
    """``weight.grad``, created as zeros on the first contribution of a step."""
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    return weight.grad
