"""fc1 of the MoE experts fused with the dispatch gather: saves the tokens and the row order, not the gathered rows.

Why: written as ``dispatch_rows`` then a grouped matmul, autograd keeps the matmul's input, the (N·k, H) expert-sorted
copy of the tokens — k times the layer's input (32 KB per token for Qwen3-30B-A3B, top-8, hidden 2048: a third of
the layer's saved bytes). The tokens themselves are kept anyway (the router's input), so this function keeps them
and the (N·k,) order and gathers the rows again in backward for the weight gradient (one gather, no arithmetic).
Forward is the same two ops; backward is autograd's for each (``grouped_mm``'s two products, then the dispatch's
sum over the k choices), so values are bit-identical to the unfused pair.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.model.token_permute import sum_choices


class GatheredGroupedMatmul(torch.autograd.Function):
    """(x (N, H) tokens, order (M,), k, w (E, out, H), offs (E,) int32 row ends) -> (M, out): row r is token
    ``order[r] // k`` through its expert's matrix (rows sorted by expert, ``offs`` their cumulative counts)."""

    # ctx: Any (forward, backward): autograd's context, carrying what forward saves for backward (torch types it so)
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, order: torch.Tensor, k: int, w: torch.Tensor, offs: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, order, w, offs)
        ctx.k = k
        return F.grouped_mm(x.index_select(0, order // k), w.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor | None, None, None, torch.Tensor | None, None]:
        x, order, w, offs = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = sum_choices(F.grouped_mm(dh, w, offs=offs), order, x.shape[0], ctx.k)
        if ctx.needs_input_grad[3]:
            rows = x.index_select(0, order // ctx.k)
            dw = F.grouped_mm(rows.t(), dh, offs=offs).transpose(-2, -1)
        return dx, None, None, dw, None


def gathered_grouped_matmul(
    x: torch.Tensor, order: torch.Tensor, k: int, w: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """``expert_matmul(dispatch_rows(x, order, k), w, counts, "grouped_mm")`` saving x and order only."""
    return GatheredGroupedMatmul.apply(x, order, k, w, counts.cumsum(0).to(torch.int32))
