"""Moving MoE rows between (token, choice) order and expert-sorted order, each direction one gather.

Why our own autograd functions: written with ``index_select`` / ``index_copy`` / ``sum``, autograd answers the
gather with a zero-filled scatter-add, the scatter with a zero-filled clone, and the sum over the k choices with an
expanded copy — three extra passes over (tokens × k × hidden) each way (measured as 30 % of the bench/moe_step.py
layer step on CPU). The two directions are each other's adjoints, so each backward is the other's forward: a
gather by ``order // k`` (the token of each sorted row) one way, a gather by the inverse permutation plus a sum over
the k choices the other. Deterministic (no atomics) whenever no assignment was dropped (the default, dropless).

``order`` (M,): positions in (token, choice) order of the expert-sorted rows; M = N·k unless the capacity factor
dropped assignments, in which case the dropped pairs contribute zero.
"""

from __future__ import annotations

from typing import Any

import torch


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def sum_choices(rows: torch.Tensor, order: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """(M, H) expert-sorted rows -> (N, H): each token's sum over its k choices."""
    if rows.shape[0] == n * k:
        return rows.index_select(0, _inverse(order)).view(n, k, -1).sum(dim=1)
    pairs = rows.new_zeros(n * k, rows.shape[1]).index_copy_(0, order, rows)  # dropped pairs stay zero
    return pairs.view(n, k, -1).sum(dim=1)


class DispatchRows(torch.autograd.Function):
    """x (N, H) -> (M, H): row r is token ``order[r] // k``."""

    # ctx: Any (forward, backward): autograd's context, carrying what forward saves for backward (torch types it so)
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.n, ctx.k = x.shape[0], k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (order,) = ctx.saved_tensors
        return sum_choices(grad, order, ctx.n, ctx.k), None, None


class CombineRows(torch.autograd.Function):
    """y (M, H) expert-sorted rows -> (N, H): each token's sum over its k choices (the adjoint of DispatchRows)."""

    # ctx: Any (forward, backward): autograd's context, carrying what forward saves for backward (torch types it so)
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, order: torch.Tensor, n: int, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return sum_choices(y, order, n, k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order // ctx.k), None, None, None


def dispatch_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    return DispatchRows.apply(x, order, k)


def combine_rows(y: torch.Tensor, order: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return CombineRows.apply(y, order, n, k)
