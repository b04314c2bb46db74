"""The MoE layer's hand-written backwards (engine.model.expert_loop, engine.model.token_permute) against autograd's
own numerical gradients (float64 ``gradcheck``) and against the plain per-expert computation."""

from __future__ import annotations

import pytest
import torch

from engine.contract.model_config import ModelConfig
from engine.model.expert_loop import loop_expert_mlp
from engine.model.lean_ops import swiglu
from engine.model.moe import GroupedExperts, _grouped_mm_works, expert_matmul
from engine.model.token_permute import combine_rows, dispatch_rows


def _expert_inputs() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    e, h, f = 6, 12, 5
    counts = torch.tensor([5, 0, 9, 3, 0, 7])  # experts without rows keep a zero gradient
    m = int(counts.sum())
    x, rw = torch.randn(m, h, dtype=torch.float64), torch.rand(m, 1, dtype=torch.float64)
    w1, w2 = torch.randn(e, 2 * f, h, dtype=torch.float64), torch.randn(e, h, f, dtype=torch.float64)
    return x, w1, w2, counts, rw


def test_fused_expert_mlp_gradients_are_exact() -> None:
    x, w1, w2, counts, rw = (t.requires_grad_() if t.is_floating_point() else t for t in _expert_inputs())
    assert torch.autograd.gradcheck(lambda a, b, c, d: loop_expert_mlp(a, b, c, counts, d), (x, w1, w2, rw))


def test_fused_expert_mlp_equals_the_per_expert_computation() -> None:
    x, w1, w2, counts, rw = _expert_inputs()
    ref = expert_matmul(swiglu(expert_matmul(x, w1, counts, "loop"), rw), w2, counts, "loop")
    torch.testing.assert_close(loop_expert_mlp(x, w1, w2, counts, rw), ref, rtol=0, atol=1e-12)


def test_fused_expert_mlp_skips_gradients_nobody_asked_for() -> None:
    x, w1, w2, counts, rw = _expert_inputs()
    x.requires_grad_()
    loop_expert_mlp(x, w1, w2, counts, rw).sum().backward()  # frozen base (LoRA-like): no weight gradient
    assert x.grad is not None and w1.grad is None and w2.grad is None


@pytest.mark.parametrize("kept", [21, 15])  # every (token, choice) pair; or some dropped by the capacity
def test_row_moves_are_each_others_adjoints(kept: int) -> None:
    torch.manual_seed(1)
    n, k, h = 7, 3, 4
    order = torch.randperm(n * k)[:kept]
    x = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    y = torch.randn(kept, h, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: dispatch_rows(a, order, k), (x,))
    assert torch.autograd.gradcheck(lambda a: combine_rows(a, order, n, k), (y,))
    ref = torch.zeros(n * k, h, dtype=torch.float64).index_copy(0, order, y.detach()).view(n, k, h).sum(1)
    torch.testing.assert_close(combine_rows(y.detach(), order, n, k), ref)
    torch.testing.assert_close(dispatch_rows(x.detach(), order, k), x.detach()[order // k])


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_gathering_their_rows_match_dispatch_then_experts_bit_for_bit(backend: str, dtype: torch.dtype) -> None:
    """``GroupedExperts(x, ..., gather=(order, k))`` keeps the tokens, not the gathered rows, and gives the same
    output and gradients as ``dispatch_rows`` followed by the experts."""
    if backend == "grouped_mm" and not _grouped_mm_works("cpu", dtype):
        pytest.skip("torch.nn.functional.grouped_mm does not run here")
    torch.manual_seed(2)
    cfg = ModelConfig(
        hidden_size=16,
        num_layers=1,
        num_attention_heads=2,
        num_query_groups=1,
        kv_channels=8,
        ffn_hidden_size=32,
        vocab_size=32,
        num_experts=6,
        moe_ffn_hidden_size=8,
        moe_router_topk=2,
    )
    experts = GroupedExperts(cfg).to(dtype)
    experts.backend = backend
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.2)
    n, k = 11, 2
    x = torch.randn(n, 16, dtype=dtype, requires_grad=True)
    expert = torch.randint(0, 6, (n * k,))
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=6)
    rw = torch.rand(n * k, 1, dtype=dtype)
    grad = torch.randn(n * k, 16, dtype=dtype)
    wanted = [x, experts.linear_fc1.weight, experts.linear_fc2.weight]
    ref = experts(dispatch_rows(x, order, k), counts, rw)
    got = experts(x, counts, rw, gather=(order, k))
    assert torch.equal(got, ref)
    for a, b in zip(torch.autograd.grad(got, wanted, grad), torch.autograd.grad(ref, wanted, grad), strict=True):
        assert torch.equal(a, b)
