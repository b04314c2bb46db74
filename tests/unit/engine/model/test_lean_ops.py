"""engine.model.lean_ops: gradients (fp64 gradcheck), forwards equal to the plain expressions, and what is saved."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from engine.model.lean_ops import (
    RMSNormFunction,
    SwiGLUFunction,
    recompute_activation,
    rms_norm,
    softmax_fp32,
    swiglu,
)


def _plain_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _saved(fn) -> list[torch.Tensor]:  # noqa: ANN001
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    return saved


def test_rms_norm_gradcheck() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, 1e-6), (x, w))


def test_swiglu_gradcheck_with_and_without_row_weight() -> None:
    torch.manual_seed(0)
    h = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    rw = torch.rand(5, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: SwiGLUFunction.apply(a, None), (h,))
    assert torch.autograd.gradcheck(lambda a, b: SwiGLUFunction.apply(a, b), (h, rw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_forward_bit_identical_and_grads_close(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 6, 32, dtype=dtype, requires_grad=True)
    w = (torch.rand(32) + 0.5).to(dtype).requires_grad_()
    ours, ref = rms_norm(x, w, 1e-6), _plain_rms_norm(x, w, 1e-6)
    assert torch.equal(ours, ref)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(ours, (x, w), g)
    want = torch.autograd.grad(ref, (x, w), g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_rms_norm_saves_input_and_fp32_rstd_only() -> None:
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved(lambda: rms_norm(x, w, 1e-6))
    assert {(tuple(t.shape), t.dtype) for t in saved} == {
        ((4, 8, 64), torch.bfloat16),
        ((64,), torch.bfloat16),
        ((4, 8, 1), torch.float32),
    }


def test_swiglu_product_is_freed_and_rebuilt_for_fc2() -> None:
    """fc1's output is all that stays saved; fc2's input is rebuilt before its backward: grads equal the plain ones."""
    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    fc1, fc2 = torch.nn.Linear(16, 2 * 24, bias=False), torch.nn.Linear(24, 16, bias=False)

    def lean() -> torch.Tensor:
        h = fc1(x)
        act = swiglu(h)
        out = fc2(act)
        recompute_activation(h, act, out)
        assert act.untyped_storage().nbytes() == 0  # freed once fc2 has read it
        return out

    def plain() -> torch.Tensor:
        gate, up = fc1(x).chunk(2, dim=-1)
        return fc2(F.silu(gate) * up)

    out = lean()
    params = (x, fc1.weight, fc2.weight)
    got = torch.autograd.grad(out.square().sum(), params)
    ref = plain()
    want = torch.autograd.grad(ref.square().sum(), params)
    assert torch.equal(out, ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_recompute_activation_releases_everything_after_backward() -> None:
    """out stays alive after backward (a pipeline stage keeps its outputs): fc1's output and the rebuilt product
    must not be kept by the rebuild hook on out's grad_fn."""
    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    fc1, fc2 = torch.nn.Linear(16, 2 * 24, bias=False), torch.nn.Linear(24, 16, bias=False)
    h = fc1(x)
    act = swiglu(h)
    out = fc2(act)
    recompute_activation(h, act, out)
    h_ref, act_ref = weakref.ref(h), weakref.ref(act)
    del h, act
    out.square().sum().backward()
    gc.collect()
    assert out.grad_fn is not None  # out and its graph node (with the hook) are still alive
    assert h_ref() is None and act_ref() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp32_softmax_saves_the_logits_and_is_bit_identical(dtype: torch.dtype) -> None:
    logits = torch.randn(8, 16, dtype=dtype, requires_grad=True)
    grad = torch.randn(8, 16)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        probs = softmax_fp32(logits)
    ref = torch.softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.equal(probs, ref)
    assert [t.dtype for t in saved] == [dtype]  # the logits only, never the fp32 probabilities of a bf16 router
    assert torch.equal(torch.autograd.grad(probs, logits, grad)[0], torch.autograd.grad(ref, logits, grad)[0])
