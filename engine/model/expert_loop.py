"""The whole SwiGLU expert MLP over expert-sorted rows as one autograd function, for the per-expert loop backend.

Why our own backward: run through autograd, the loop over experts pays for its bookkeeping, not its matmuls —
``unbind`` of the stacked weights stacks every expert's gradient back (a copy of each weight), ``split``/``cat``
copy every activation and gradient once more, and each intermediate gets its own zero-filled buffer. Measured on
the bench/moe_step.py layer (4,096 tokens, 64 experts, top-8, one CPU thread): matmuls were 35 % of the step;
copy/cat/fill 42 %. Here every matmul writes its result straight into its slice of one preallocated buffer
(``torch.mm(out=...)``), the weight gradients land in their (E, out, in) tensor in place, and the backward
recomputes the activation from the saved pre-activation instead of saving it.

Math (row r of expert e, routing weight w_r; fc1 = [gate; up] per expert, as ``engine.model.moe.GroupedExperts``):
    h = x W1_e^T,  a = silu(g) * u,  y = (w_r a) W2_e^T
Gradients: dA = dy W2_e (of w_r a), dw_r = <dA, a>, da = w_r dA, dg = da * u * silu'(g), du = da * silu(g),
dx = [dg; du] W1_e, dW1_e = [dg; du]^T x, dW2_e = dy^T (w_r a).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.model.token_permute import sum_choices


def _spans(sizes: list[int]) -> list[tuple[int, int, int]]:
    """(expert, start, stop) of every non-empty expert's rows."""
    spans, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            spans.append((e, start, start + n))
        start += n
    return spans


class LoopExpertMLP(torch.autograd.Function):
    """(x (M, H), w1 (E, 2F, H), w2 (E, H, F), row_weight (M, 1), sizes) -> (M, H); see the module docstring.
    With ``order`` (M,) and ``k``, x is the (N, H) tokens and row r is token ``order[r] // k`` (the dispatch
    gather done here, so that x and order are saved rather than the k-times-larger gathered rows)."""

    # ctx: Any (forward, backward): autograd's context, carrying what forward saves for backward (torch types it so)
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        row_weight: torch.Tensor,
        sizes: list[int],
        order: torch.Tensor | None = None,
        k: int = 1,
    ) -> torch.Tensor:
        spans = _spans(sizes)
        ctx.k = k
        tokens, x = x, _rows(x, order, k)
        h = x.new_empty(x.shape[0], w1.shape[1])
        for e, a, b in spans:
            torch.mm(x[a:b], w1[e].t(), out=h[a:b])
        gate, up = h.chunk(2, dim=-1)
        act = F.silu(gate).mul_(up).mul_(row_weight)
        y = x.new_empty(x.shape[0], w2.shape[1])
        for e, a, b in spans:
            torch.mm(act[a:b], w2[e].t(), out=y[a:b])
        ctx.save_for_backward(tokens, w1, w2, row_weight, h, order)
        ctx.spans = spans
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tokens, w1, w2, row_weight, h, order = ctx.saved_tensors
        spans: list[tuple[int, int, int]] = ctx.spans
        dy = dy.contiguous()
        gate, up = h.chunk(2, dim=-1)
        silu_g = F.silu(gate)
        act = silu_g * up  # unweighted
        d_wact = h.new_empty(act.shape)
        for e, a, b in spans:
            torch.mm(dy[a:b], w2[e], out=d_wact[a:b])
        d_row = (d_wact * act).sum(-1, keepdim=True) if ctx.needs_input_grad[3] else None
        dw2 = None
        if ctx.needs_input_grad[2]:
            dw2 = _expert_grad(w2, spans)
            act.mul_(row_weight)  # now the forward's input of fc2
            for e, a, b in spans:
                torch.mm(dy[a:b].t(), act[a:b], out=dw2[e])
        d_act = d_wact.mul_(row_weight)
        dh = torch.empty_like(h)
        f = gate.shape[1]
        dh[:, :f] = torch.ops.aten.silu_backward(d_act * up, gate)  # one fused kernel for silu'(g)
        torch.mul(d_act, silu_g, out=dh[:, f:])
        dx = None
        if ctx.needs_input_grad[0]:
            dx = h.new_empty(h.shape[0], w1.shape[2])
            for e, a, b in spans:
                torch.mm(dh[a:b], w1[e], out=dx[a:b])
            if order is not None:
                dx = sum_choices(dx, order, tokens.shape[0], ctx.k)
        dw1 = None
        if ctx.needs_input_grad[1]:
            dw1 = _expert_grad(w1, spans)
            x = _rows(tokens, order, ctx.k)  # the gathered rows again
            for e, a, b in spans:
                torch.mm(dh[a:b].t(), x[a:b], out=dw1[e])
        return dx, dw1, dw2, d_row, None, None, None


def _rows(x: torch.Tensor, order: torch.Tensor | None, k: int) -> torch.Tensor:
    return x if order is None else x.index_select(0, order // k)


def _expert_grad(w: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """A gradient buffer like ``w`` whose experts without rows are zero (the others are overwritten)."""
    grad = torch.empty_like(w)
    busy = {e for e, _, _ in spans}
    for e in range(w.shape[0]):
        if e not in busy:
            grad[e].zero_()
    return grad


def loop_expert_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    counts: torch.Tensor,
    row_weight: torch.Tensor,
    order: torch.Tensor | None = None,
    k: int = 1,
) -> torch.Tensor:
    """The expert MLP of ``GroupedExperts`` on the loop backend (one host sync for the counts); with ``order``,
    x is the tokens, gathered here (``LoopExpertMLP``)."""
    return LoopExpertMLP.apply(x, w1, w2, row_weight, counts.tolist(), order, k)
