"""Memory-bounded cross-entropy over the output head (Qwen3's 151,936-word vocabulary).

Full logits are the biggest activation of an SFT step (b8 × s2048 × 151,936 fp32 = 10 GB, plus as much again for
their gradient; docs/anchors-engine.md §4). ``chunked_cross_entropy`` takes the final hidden states and the head matrix
instead of logits and walks over row chunks: each chunk's logits (chunk × V, fp32) are computed, turned into the
loss and, in the same pass, into the gradients for the hidden rows and the head matrix (as Liger-Kernel's fused
linear cross-entropy does), then freed. Nothing of size (B·T, V) exists at any time, and backward only rescales the
stored gradients. Rows whose label is ``ignore_index`` are dropped before the head matmul (prompt tokens in SFT cost
nothing; TRL's ``chunked_nll`` does the same).
"""

from __future__ import annotations

import torch

from engine.contract.constants import IGNORE_INDEX


class _ChunkedLinearCE(torch.autograd.Function):
    """sum_i CE(h_i @ W^T, y_i) over the given rows, gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, grad_hidden, grad_weight):
        loss, gh, gw = _chunked_loss_and_grads(
            hidden, weight, labels, chunk_size, ignore_index, grad_hidden, grad_weight
        )
        none = torch.empty(0, device=hidden.device)  # placeholder of a gradient not wanted (LoRA's frozen head)
        ctx.save_for_backward(gh if gh is not None else none, gw if gw is not None else none)
        ctx.has = (gh is not None, gw is not None)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        gh, gw = ctx.saved_tensors
        d_hidden = gh * grad_loss.to(gh.dtype) if ctx.has[0] else None
        d_weight = (gw * grad_loss).to(ctx.weight_dtype) if ctx.has[1] else None
        return d_hidden, d_weight, None, None, None, None, None


def _chunked_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    ignore_index: int,
    want_gh: bool,
    want_gw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """hidden (N, H), weight (V, H), labels (N,) -> (loss sum fp32, dL/dhidden, dL/dweight in fp32)."""
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    gh = torch.empty_like(hidden) if want_gh else None
    gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_gw else None
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start : start + chunk_size]  # (c, H)
        y = labels[start : start + chunk_size]  # (c,)
        keep = (y != ignore_index)[:, None]  # (c, 1)
        y = y.masked_fill(~keep[:, 0], 0)  # any valid index; the row is zeroed below
        logits = (h @ weight.t()).float()  # (c, V): the only vocab-sized buffer, one chunk at a time
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (c, 1)
        loss += ((lse - logits.gather(1, y[:, None])) * keep).sum()
        if gh is None and gw is None:
            continue
        # d(sum CE)/d logits = softmax - onehot, computed in place over the logits buffer
        dlogits = logits.sub_(lse).exp_()
        dlogits[torch.arange(y.shape[0], device=y.device), y] -= 1.0
        dlogits = dlogits.mul_(keep).to(weight.dtype)
        if gh is not None:
            gh[start : start + chunk_size] = dlogits @ weight  # (c, H)
        if gw is not None:  # (V, H), accumulated in fp32
            if dlogits.dtype == gw.dtype:
                gw.addmm_(dlogits.t(), h)  # into gw: no second vocab-sized buffer
            else:
                gw += (dlogits.t() @ h).float()
    return loss, gh, gw


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 256,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies of ``hidden @ weight.T`` against ``labels``, and the number of counted tokens.

    Args:
        hidden: (B, T, H) or (N, H) final-norm hidden states (``model(..., return_hidden=True)``).
        weight: (V, H) head matrix (``model.output_weight()``).
        labels: (B, T) or (N,) target ids aligned with ``hidden`` (already shifted: row t predicts labels[t]);
            ``ignore_index`` rows count neither in the loss nor in the token count.
        chunk_size: rows per chunk; peak extra memory is about chunk_size × V × 8 bytes.
    Returns:
        (loss_sum fp32 scalar, num_tokens int64 scalar), so the trainer can normalise by the global token count.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be positive, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels: shape {tuple(labels.shape)} does not match hidden {tuple(hidden.shape[:-1])}")
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    y = labels.reshape(-1)
    want_grad = torch.is_grad_enabled()
    loss = _ChunkedLinearCE.apply(
        h, weight, y, chunk_size, ignore_index, want_grad and h.requires_grad, want_grad and weight.requires_grad
    )
    return loss, (y != ignore_index).sum()
