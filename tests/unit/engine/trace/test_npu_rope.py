"""RoPE on NPU (``lean_ops.RopeFunction`` around torch_npu's ``npu_rotary_mul``): the plain path's forward and
gradients, and only the cos/sin tables kept for backward where the kernel's own autograd keeps q/k before RoPE."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.model.lean_ops import RopeFunction, rope_math


def _tables(b: int, t: int, d: int, dtype: torch.dtype, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    # as engine.model.rope.rope_cos_sin builds them: halves repeated, cos/sin (B, 1, T, d); YaRN scales both
    freqs = torch.arange(t, dtype=torch.float64)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat([freqs, freqs], dim=-1).expand(b, 1, t, d)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


@pytest.mark.parametrize("scale", [1.0, 1.2])
def test_rope_function_matches_autograd_through_the_plain_rope(scale: float) -> None:
    torch.manual_seed(0)
    cos, sin = _tables(2, 7, 16, torch.float32, scale)
    x = torch.randn(2, 3, 7, 16, requires_grad=True)
    ours, ref = RopeFunction.apply(x, cos, sin, rope_math), rope_math(x, cos, sin)
    assert torch.equal(ours, ref)
    dy = torch.randn_like(ref)
    (got,) = torch.autograd.grad(ours, x, dy)
    (want,) = torch.autograd.grad(ref, x, dy)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_rope_function_gradcheck() -> None:
    cos, sin = _tables(1, 5, 8, torch.float64, 1.1)
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: RopeFunction.apply(a, cos, sin, rope_math), (x,))


# Run in a fresh process: the autograd engine sizes its device queues when it first starts, so a backward on the
# fake npu device fails in a process that ran a CPU backward before the backend was registered.
_FAKE_NPU_CHECK = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from engine.trace.backend import prepare
prepare("npu")
import torch_npu
from engine.model.lean_ops import apply_rope

def saved_bytes(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    out.sum().backward()
    return sum(t.numel() * t.element_size() for t in saved)

with FakeTensorMode(allow_non_fake_inputs=True):
    x = torch.empty(2, 4, 6, 64, dtype=torch.bfloat16, device="npu", requires_grad=True)
    cos = torch.empty(2, 1, 6, 64, dtype=torch.bfloat16, device="npu")
    print(saved_bytes(lambda: torch_npu.npu_rotary_mul(x, cos, cos)), saved_bytes(lambda: apply_rope(x, cos, cos)))
    assert x.grad is not None and x.grad.shape == x.shape
# past the checks, leave without static destructors: the autograd engine's thread for the fake device is sometimes
# still joinable then and the process aborts (-6, "terminate called without an active exception") after a correct run
import os, sys
sys.stdout.flush()
os._exit(0)
"""


def test_npu_rope_keeps_only_the_tables_where_the_fused_kernel_keeps_its_input() -> None:
    """Under the trace's fake ``npu_rotary_mul`` (torch_npu's autograd: x, r1, r2 saved) ``apply_rope`` on an NPU
    tensor keeps cos and sin only, and its backward runs the fused kernel with -sin (shape-checked by the fake)."""
    run = subprocess.run([sys.executable, "-c", _FAKE_NPU_CHECK], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    fused, ours = map(int, run.stdout.split())
    tables, x = 2 * (2 * 6 * 64) * 2, (2 * 4 * 6 * 64) * 2  # bf16 cos + sin, and x
    assert (fused, ours) == (tables + x, tables)
