"""RMSNorm, SwiGLU and RoPE that keep only what their backward needs (Megatron's activation budget).

What autograd would save, and what these save instead, per token of a bf16 layer:
- RMSNorm (layer norms and the q/k norms), computed in fp32 and cast back before the weight (as transformers):
  plain autograd keeps the fp32 copy of the input, its square and the normalised fp32 rows; ``RMSNormFunction``
  keeps the input in its own dtype and the fp32 reciprocal RMS (one float per row) and rebuilds the rest.
- SwiGLU ``silu(gate) * up``: plain autograd keeps ``silu(gate)`` and ``up`` next to fc1's output, and fc2 keeps the
  product as its input. ``SwiGLUFunction`` keeps fc1's output only; ``recompute_activation`` then frees the
  product once fc2 has consumed it and rebuilds it from fc1's output just before fc2's backward needs it (MindSpeed's
  ``--recompute-activation-function``: one elementwise pass per layer in backward).
- RoPE saves nothing but the shared cos/sin tables.
On Ascend (``torch_npu`` loaded, NPU tensors) the fused ``npu_rms_norm`` / ``npu_swiglu`` / ``npu_rotary_mul``
kernels run instead: they save the same (input and rstd; fc1's output; nothing: ``npu_rotary_mul``'s own autograd
would keep its input, so ``RopeFunction`` wraps it). Every forward here is the plain
torch expression's, op for op, so results are bit-identical to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate

from engine.model.kernels import npu_fused_ops
from engine.torch_compat import in_backward


class RMSNormFunction(torch.autograd.Function):
    """y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), normalised in fp32 (fp64 for fp64 input)."""

    @staticmethod
    # ctx: Any: autograd's context, which carries what forward saves for backward (torch types it so)
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(_norm_dtype(x))
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(_norm_dtype(x)) * rstd  # the normalised rows, rebuilt
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (dy * xhat.to(x.dtype)).sum(dim=tuple(range(dy.dim() - 1))).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            # the gradient reaching the normalised rows is rounded to x's dtype, as autograd's cast back does
            g = (dy * weight).to(x.dtype).to(xhat.dtype)
            dx = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, None


def _norm_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; the fused kernel on NPU."""
    npu = npu_fused_ops(x.device.type)
    if npu is None:
        return RMSNormFunction.apply(x, weight, eps)
    if isinstance(x, DTensor):
        return _npu_rms_norm_local(npu.npu_rms_norm, x, weight, eps)
    return npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]


def _npu_rms_norm_local(kernel: Callable[..., Any], x: DTensor, weight: torch.Tensor, eps: float) -> DTensor:
    """Under TP, x and the norm weight are DTensors and DTensor has no sharding strategy for torch_npu's
    ``npu_rms_norm``: run it on x's local rows and the replicated weight. Each row is normalised on its own, so x may
    be sharded on any dim but the last; the weight's gradient is then a partial sum on every mesh dim that shards x."""
    mesh, placements = x.device_mesh, x.placements
    if any(p.is_partial() or p.is_shard(x.dim() - 1) for p in placements):
        raise ValueError(f"rms_norm: x must be replicated or sharded off its last dim on NPU, got {placements}")
    if not isinstance(weight, DTensor) or weight.device_mesh != mesh:
        raise ValueError("rms_norm: on NPU a DTensor x needs its norm weight as a DTensor on x's mesh")
    w = weight.redistribute(mesh, [Replicate()] * mesh.ndim)
    w_grad = [Partial() if p.is_shard() else Replicate() for p in placements]
    y = kernel(x.to_local(), w.to_local(grad_placements=w_grad).to(x.dtype), epsilon=eps)[0]
    return DTensor.from_local(y, mesh, placements, shape=x.shape, stride=x.stride())


def _swiglu_math(h: torch.Tensor, row_weight: torch.Tensor | None) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate) * up
    return act if row_weight is None else act * row_weight


class SwiGLUFunction(torch.autograd.Function):
    """h = [gate; up] (last dim) -> silu(gate) * up (* row_weight, the MoE routing weight of each row)."""

    @staticmethod
    # ctx: Any: autograd's context, which carries what forward saves for backward (torch types it so)
    def forward(ctx: Any, h: torch.Tensor, row_weight: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(h, row_weight)
        return _swiglu_math(h, row_weight)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, row_weight = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        silu_g = F.silu(gate)
        d_row = None
        if row_weight is not None:
            if ctx.needs_input_grad[1]:
                d_row = (dy * (silu_g * up)).sum(-1, keepdim=True).to(row_weight.dtype)
            dy = dy * row_weight
        dh = torch.cat([torch.ops.aten.silu_backward(dy * up, gate), dy * silu_g], dim=-1)
        return dh, d_row


def swiglu(h: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for h = [gate; up], saving h only; the fused kernel on NPU."""
    npu = npu_fused_ops(h.device.type)
    if npu is not None:
        act = npu.npu_swiglu(h, dim=-1)
        return act if row_weight is None else act * row_weight
    return SwiGLUFunction.apply(h, row_weight)


def recompute_activation(
    h: torch.Tensor, act: torch.Tensor, out: torch.Tensor, row_weight: torch.Tensor | None = None
) -> None:
    """``act = swiglu(h, row_weight)`` was just consumed by fc2, giving ``out``: free act until ``out``'s gradient
    arrives (``free_until_grad``)."""
    free_until_grad(act, out, lambda: swiglu_values(h, row_weight))


def free_until_grad(act: torch.Tensor, out: torch.Tensor, values: Callable[[], torch.Tensor]) -> None:
    """``act`` was just consumed by a module that saved it, giving ``out``: free act's memory now and rebuild it in
    place from ``values()`` when ``out``'s gradient arrives (before that module's backward reads it; any module that
    saved act, LoRA's adapters or a DTensor wrapping it included, sees the rebuilt values). Nothing is done outside
    autograd or for tensor subclasses (their storage is not act's), nor in a forward run inside backward (an
    activation-checkpoint recompute: the graph being differentiated is not the one ``out`` belongs to)."""
    if not (torch.is_grad_enabled() and out.requires_grad and type(act) is torch.Tensor and act.is_contiguous()):
        return
    if in_backward():
        return
    size = act.untyped_storage().nbytes()
    # The hook stays on out's grad_fn as long as out lives (a pipeline stage keeps its outputs): it must hold
    # nothing once it has run, or what ``values`` reads and the rebuilt tensor outlive backward.
    held: list[Any] = [act, values]

    def rebuild(grad: torch.Tensor) -> None:
        if not held:
            return
        act_, values_ = held
        held.clear()
        storage = act_.untyped_storage()
        if storage.nbytes() != size:
            storage.resize_(size)
            with torch.no_grad():  # through .data: the same memory, but not a modification autograd must refuse
                act_.data.copy_(values_())

    out.register_hook(rebuild)
    act.untyped_storage().resize_(0)


_REBUILD = "_llmjobs_rebuild"


def mark_rebuildable(t: torch.Tensor, values: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Tell ``t``'s consumer that ``values()`` rebuilds it (from tensors autograd keeps anyway), so that it may free
    ``t`` until backward (``take_rebuild`` + ``free_until_grad``); returns ``t``."""
    setattr(t, _REBUILD, values)
    return t


def take_rebuild(t: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """The rebuild ``mark_rebuildable`` attached to ``t``, detached from it (so ``t`` no longer holds its inputs)."""
    values: Callable[[], torch.Tensor] | None = t.__dict__.pop(_REBUILD, None)
    return values


def swiglu_values(h: torch.Tensor, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The SwiGLU forward without autograd (the rebuild of a freed activation)."""
    npu = npu_fused_ops(h.device.type)
    if npu is not None:
        act = npu.npu_swiglu(h, dim=-1)
        return act if row_weight is None else act * row_weight
    return _swiglu_math(h, row_weight)


class Fp32Softmax(torch.autograd.Function):
    """softmax(logits, dtype=float32) saving the logits in their own dtype (bf16: half the bytes of the fp32
    probabilities autograd keeps) and recomputing the probabilities in backward (the MoE router's)."""

    @staticmethod
    # ctx: Any: autograd's context, which carries what forward saves for backward (torch types it so)
    def forward(ctx: Any, logits: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits)
        return torch.softmax(logits, dim=-1, dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (logits,) = ctx.saved_tensors
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        return torch.ops.aten._softmax_backward_data(grad, probs, -1, torch.float32).to(logits.dtype)


def softmax_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Probabilities in fp32 over the last dim; saves the logits (``Fp32Softmax``) where they are narrower."""
    if logits.element_size() >= 4:
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    return Fp32Softmax.apply(logits)


RopeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RopeFunction(torch.autograd.Function):
    """Rotate-half RoPE through ``kernel`` (torch_npu's ``npu_rotary_mul`` on NPU), saving only cos/sin.

    torch_npu's own autograd for ``npu_rotary_mul`` keeps x (q and k before RoPE: 2 (a + g) d bytes per token per
    layer the planner does not count). RoPE is linear in x, and its transpose is the rotation the other way:
    dx = rope(dy, cos, -sin) for tables whose halves repeat (cos = [c, c], sin = [s, s], as ``rope_cos_sin`` builds
    them, YaRN's scale included), so backward needs only the tables.
    cos/sin take no gradient here (``apply_rope`` sends tables that need one to the kernel's own autograd)."""

    @staticmethod
    # ctx: Any: autograd's context, which carries what forward saves for backward (torch types it so)
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernel: RopeKernel) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.kernel = kernel
        return kernel(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        return ctx.kernel(dy, cos, -sin), None, None, None


def rope_math(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in plain torch (autograd saves only cos/sin: the products' other factors)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, T, d), cos/sin broadcastable to it: rotate-half RoPE (pairs (i, i + d/2), the HF/Qwen convention)."""
    npu = npu_fused_ops(x.device.type)
    if npu is None:
        return rope_math(x, cos, sin)
    if cos.requires_grad or sin.requires_grad:
        return npu.npu_rotary_mul(x, cos, sin)
    return RopeFunction.apply(x, cos, sin, npu.npu_rotary_mul)
