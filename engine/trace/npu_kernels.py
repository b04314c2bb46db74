"""``torch_npu``'s fused kernels that the engine calls, as real ``torch.library`` ops with fake implementations only.

Schemas follow torch_npu's documented signatures (Ascend "torch_npu API" pages, op-plugin's ``npu_native_functions``
and its meta registrations); output shapes and dtypes follow the documented outputs; the backward saves what
torch_npu's autograd saves (its ``derivatives.yaml``), so the activations a trace measures are the kernel's:

- ``npu_fusion_attention`` -> (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels):
  softmax_max/sum fp32, [T, N, 8] in TND layout, [B, N, S1, 8] otherwise; softmax_out empty. Backward
  ``npu_fusion_attention_grad`` from q, k, v, the mask, softmax_max/sum/out and attention_out.
- ``npu_rms_norm`` -> (y, rstd): rstd fp32 with gamma's dims reduced to 1; backward from x, gamma, rstd.
- ``npu_swiglu`` -> the last (``dim``) axis halved; backward from x.
- ``npu_rotary_mul`` -> x's shape and dtype; backward from x, r1, r2 (the docs: x is kept for backward).

Each fake checks the documented argument constraints (layouts, dtypes, ranks, head counts, TND's cumulative lengths,
sparse_mode 2-4's 2048 × 2048 mask), so a wrong call fails in the trace with torch_npu's complaint, not on a device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_BIG = 2147483647

_SCHEMAS = {
    "npu_fusion_attention": (
        "(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None, "
        "Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
        "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
        "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, "
        "bool sync=False) -> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
    ),
    "npu_fusion_attention_grad": (
        "(Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, str input_layout, *, Tensor? pse=None, "
        "Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? softmax_max=None, Tensor? softmax_sum=None, "
        "Tensor? softmax_in=None, Tensor? attention_in=None, float scale_value=1., float keep_prob=1., "
        "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int seed=0, int offset=0, "
        "int numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, "
        "int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "npu_rms_norm": "(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_rms_norm_backward": "(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)",
    "npu_swiglu": "(Tensor self, int dim=-1) -> Tensor",
    "npu_swiglu_backward": "(Tensor grad_output, Tensor self, int dim=-1) -> Tensor",
    "npu_rotary_mul": "(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor",
    "npu_rotary_mul_backward": (
        "(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> (Tensor, Tensor, Tensor)"
    ),
}
FUSED = ("npu_fusion_attention", "npu_rms_norm", "npu_swiglu", "npu_rotary_mul")


def _check(ok: bool, op: str, message: str) -> None:
    torch._check(ok, lambda: f"torch_npu.{op}: {message}")


# --- npu_fusion_attention ---------------------------------------------------------------------------------------


def _check_cumulative(op: str, name: str, lengths: Sequence[int] | None, total: int) -> None:
    _check(lengths is not None and len(lengths) > 0, op, f"input_layout TND needs {name} (cumulative lengths)")
    assert lengths is not None
    _check(all(b >= a for a, b in zip([0, *lengths], lengths, strict=False)), op, f"{name} must not decrease")
    _check(lengths[-1] == total, op, f"{name}[-1] = {lengths[-1]} must equal T = {total} (no leading 0)")


def _attention_dims(op: str, q: torch.Tensor, k: torch.Tensor, head_num: int, layout: str) -> tuple[int, int, int]:
    """(B, S1, kv heads) of a documented layout; checks ranks and head counts."""
    _check(layout in _LAYOUTS, op, f"input_layout must be one of {_LAYOUTS}, got {layout!r}")
    dims = 3 if layout in ("BSH", "SBH", "TND") else 4
    _check(q.dim() == dims and k.dim() == dims, op, f"{layout} wants {dims}-d query/key, got {q.dim()}/{k.dim()}")
    if layout == "TND":
        _check(q.size(1) == head_num, op, f"head_num {head_num} != query's N {q.size(1)}")
        return 1, q.size(0), k.size(1)
    if layout in ("BSH", "SBH"):
        _check(q.size(2) % head_num == 0, op, f"H {q.size(2)} not divisible by head_num {head_num}")
        d = q.size(2) // head_num
        b, s = (q.size(0), q.size(1)) if layout == "BSH" else (q.size(1), q.size(0))
        return b, s, k.size(2) // d
    n_axis = 1 if layout == "BNSD" else 2
    _check(q.size(n_axis) == head_num, op, f"head_num {head_num} != query's N {q.size(n_axis)}")
    s_axis = 3 - n_axis
    return q.size(0), q.size(s_axis), k.size(n_axis)


def _fusion_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = _BIG,
    next_tockens: int = _BIG,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
) -> tuple[Any, ...]:
    op = "npu_fusion_attention"
    _check(query.dtype in _HALF, op, f"query must be float16/bfloat16, got {query.dtype}")
    _check(query.dtype == key.dtype == value.dtype, op, "query, key and value must share one dtype")
    _check(key.shape == value.shape, op, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    b, s1, kv_heads = _attention_dims(op, query, key, head_num, input_layout)
    _check(kv_heads > 0 and head_num % kv_heads == 0, op, f"head_num {head_num} not a multiple of key's {kv_heads}")
    _check(0.0 < keep_prob <= 1.0, op, f"keep_prob must lie in (0, 1], got {keep_prob}")
    _check(sparse_mode in range(9), op, f"sparse_mode must be 0..8, got {sparse_mode}")
    if input_layout == "TND":
        _check_cumulative(op, "actual_seq_qlen", actual_seq_qlen, query.size(0))
        _check_cumulative(op, "actual_seq_kvlen", actual_seq_kvlen, key.size(0))
    if sparse_mode in (2, 3, 4):
        _check(atten_mask is not None, op, f"sparse_mode {sparse_mode} needs the compressed atten_mask")
        assert atten_mask is not None
        _check(tuple(atten_mask.shape) == (2048, 2048), op, f"sparse_mode {sparse_mode} wants a 2048 x 2048 mask")
    if atten_mask is not None:
        _check(
            atten_mask.dtype in (torch.bool, torch.uint8), op, f"atten_mask must be bool/uint8, not {atten_mask.dtype}"
        )
    stats = [query.size(0), head_num, 8] if input_layout == "TND" else [b, head_num, s1, 8]
    out = query.new_empty(query.shape)
    softmax_max = query.new_empty(stats, dtype=torch.float32)
    softmax_sum = query.new_empty(stats, dtype=torch.float32)
    softmax_out = query.new_empty([0])
    return out, softmax_max, softmax_sum, softmax_out, 0, 0, 0


def _fusion_attention_grad_fake(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dy: torch.Tensor, *args: object, **kwargs: object
) -> tuple[torch.Tensor, ...]:
    _check(dy.shape == query.shape, "npu_fusion_attention_grad", "dy must be shaped as query")
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), query.new_empty([0])


_ATTENTION_ARGS = [
    "query",
    "key",
    "value",
    "head_num",
    "input_layout",
    "pse",
    "padding_mask",
    "atten_mask",
    "scale",
    "keep_prob",
    "pre_tockens",
    "next_tockens",
    "inner_precise",
    "prefix",
    "actual_seq_qlen",
    "actual_seq_kvlen",
    "sparse_mode",
    "gen_mask_parallel",
    "sync",
]


# ctx: Any below: autograd's context object, which carries the attributes a setup gives it (ctx.args, ctx.dim)
def _fusion_attention_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    args = dict(zip(_ATTENTION_ARGS, inputs, strict=True))
    ctx.args = {k: v for k, v in args.items() if not isinstance(v, torch.Tensor) and v is not None}
    out, smax, ssum, sout, seed, offset, numels = output
    ctx.stats = (seed, offset, numels)
    tensors = (args["query"], args["key"], args["value"], args["pse"], args["padding_mask"], args["atten_mask"])
    ctx.save_for_backward(*tensors, smax, ssum, sout, out)


def _fusion_attention_backward(ctx: Any, dy: torch.Tensor, *unused: object) -> tuple[torch.Tensor | None, ...]:
    q, k, v, pse, padding_mask, mask, smax, ssum, sout, out = ctx.saved_tensors
    a = ctx.args
    dq, dk, dv, _ = torch.ops.npu.npu_fusion_attention_grad(
        q,
        k,
        v,
        dy,
        a["head_num"],
        a["input_layout"],
        pse=pse,
        padding_mask=padding_mask,
        atten_mask=mask,
        softmax_max=smax,
        softmax_sum=ssum,
        softmax_in=sout,
        attention_in=out,
        scale_value=a["scale"],
        keep_prob=a["keep_prob"],
        pre_tockens=a["pre_tockens"],
        next_tockens=a["next_tockens"],
        inner_precise=a["inner_precise"],
        seed=ctx.stats[0],
        offset=ctx.stats[1],
        numels=ctx.stats[2],
        prefix=a.get("prefix"),
        actual_seq_qlen=a.get("actual_seq_qlen"),
        actual_seq_kvlen=a.get("actual_seq_kvlen"),
        sparse_mode=a["sparse_mode"],
    )
    return (dq, dk, dv) + (None,) * (len(_ATTENTION_ARGS) - 3)


# --- npu_rms_norm -----------------------------------------------------------------------------------------------


def _rms_norm_fake(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    op = "npu_rms_norm"
    _check(x.dtype in _FLOAT and gamma.dtype == x.dtype, op, f"x {x.dtype} and gamma {gamma.dtype}: one float dtype")
    _check(0 < gamma.dim() <= x.dim(), op, f"gamma ({gamma.dim()}-d) must not outrank x ({x.dim()}-d)")
    _check(tuple(x.shape[x.dim() - gamma.dim() :]) == tuple(gamma.shape), op, "gamma must match x's trailing dims")
    rstd = [*x.shape[: x.dim() - gamma.dim()], *([1] * gamma.dim())]
    return x.new_empty(x.shape), x.new_empty(rstd, dtype=torch.float32)


def _rms_norm_backward_fake(
    dy: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(dy.shape == x.shape, "npu_rms_norm_backward", "dy must be shaped as x")
    return x.new_empty(x.shape), gamma.new_empty(gamma.shape)


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _rms_norm_backward(ctx: Any, dy: torch.Tensor, _drstd: object) -> tuple[torch.Tensor | None, ...]:
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.npu.npu_rms_norm_backward(dy, x, gamma, rstd)
    return dx, dgamma, None


# --- npu_swiglu -------------------------------------------------------------------------------------------------


def _swiglu_fake(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    _check(x.dtype in _FLOAT, "npu_swiglu", f"x must be float16/bfloat16/float32, got {x.dtype}")
    _check(x.size(dim) % 2 == 0, "npu_swiglu", f"x's dim {dim} ({x.size(dim)}) must be even: [gate; up]")
    shape = list(x.shape)
    shape[dim] //= 2
    return x.new_empty(shape)


def _swiglu_backward_fake(grad_output: torch.Tensor, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    _check(grad_output.size(dim) * 2 == x.size(dim), "npu_swiglu_backward", "grad_output must be half of x")
    return x.new_empty(x.shape)


def _swiglu_setup(ctx: Any, inputs: tuple[Any, ...], output: object) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.dim = inputs[1]


def _swiglu_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    (x,) = ctx.saved_tensors
    return torch.ops.npu.npu_swiglu_backward(grad, x, ctx.dim), None


# --- npu_rotary_mul ---------------------------------------------------------------------------------------------


def _rotary_mul_fake(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    op = "npu_rotary_mul"
    _check(rotary_mode in ("half", "interleave"), op, f"rotary_mode must be half/interleave, got {rotary_mode!r}")
    _check(x.dim() == r1.dim() == r2.dim() == 4, op, f"x, r1, r2 must be 4-d, got {x.dim()}/{r1.dim()}/{r2.dim()}")
    _check(x.dtype in _FLOAT and x.dtype == r1.dtype == r2.dtype, op, f"x {x.dtype}, r1 {r1.dtype}, r2 {r2.dtype}")
    _check(r1.shape == r2.shape, op, f"r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} differ")
    d = x.size(3)
    _check(d % 2 == 0 and d < 896 and r1.size(3) == d, op, f"D {d} must be even, < 896 and r1/r2's last dim")
    _check(all(a in (1, b) for a, b in zip(r1.shape, x.shape, strict=True)), op, "r1/r2 must broadcast to x")
    _check(x.size(0) < 1000 and x.size(1) < 1000, op, f"B, N < 1000 (x {tuple(x.shape)})")
    return x.new_empty(x.shape)


def _rotary_mul_backward_fake(
    grad: torch.Tensor, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(grad.shape == x.shape, "npu_rotary_mul_backward", "grad must be shaped as x")
    return x.new_empty(x.shape), r1.new_empty(r1.shape), r2.new_empty(r2.shape)


def _rotary_mul_setup(ctx: Any, inputs: tuple[Any, ...], output: object) -> None:
    ctx.save_for_backward(*inputs[:3])
    ctx.mode = inputs[3]


def _rotary_mul_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, r1, r2 = ctx.saved_tensors
    dx, dr1, dr2 = torch.ops.npu.npu_rotary_mul_backward(grad, x, r1, r2, ctx.mode)
    return dx, dr1 if ctx.needs_input_grad[1] else None, dr2 if ctx.needs_input_grad[2] else None, None


_FAKES: dict[str, Callable[..., Any]] = {
    "npu_fusion_attention": _fusion_attention_fake,
    "npu_fusion_attention_grad": _fusion_attention_grad_fake,
    "npu_rms_norm": _rms_norm_fake,
    "npu_rms_norm_backward": _rms_norm_backward_fake,
    "npu_swiglu": _swiglu_fake,
    "npu_swiglu_backward": _swiglu_backward_fake,
    "npu_rotary_mul": _rotary_mul_fake,
    "npu_rotary_mul_backward": _rotary_mul_backward_fake,
}
_AUTOGRAD: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "npu_fusion_attention": (_fusion_attention_backward, _fusion_attention_setup),
    "npu_rms_norm": (_rms_norm_backward, _rms_norm_setup),
    "npu_swiglu": (_swiglu_backward, _swiglu_setup),
    "npu_rotary_mul": (_rotary_mul_backward, _rotary_mul_setup),
}


@functools.cache
def register() -> torch.library.Library:
    """Define the ops under torch_npu's namespace (``torch.ops.npu``) once per process; returns the library."""
    lib = torch.library.Library("npu", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        lib.define(name + schema)
        torch.library.register_fake(f"npu::{name}", _FAKES[name], lib=lib)
    for name, (backward, setup) in _AUTOGRAD.items():
        torch.library.register_autograd(f"npu::{name}", backward, setup_context=setup, lib=lib)
    return lib


def install(module: object) -> None:
    """Expose the fused kernels on the stand-in ``torch_npu`` module, as torch_npu exposes its ops."""
    register()
    for name in FUSED:
        setattr(module, name, getattr(torch.ops.npu, name))
