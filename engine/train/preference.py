"""Preference losses (DPO and its relatives) over per-sequence log-probabilities, and those log-probabilities taken
from the output head without full logits.

``sequence_logprobs`` sums log p(label) over each sequence's labelled tokens through ``_TokenLogprobs``: forward
walks the labelled rows in chunks keeping only each row's log-sum-exp; backward recomputes one chunk's logits at a
time (the gradient of a per-sequence sum is not known until the loss is, so it cannot be folded into forward as
``engine.model.loss`` does). Nothing of size (tokens × vocabulary) is ever held: one chunk's logits in fp32.

``preference_loss`` follows TRL's ``DPOTrainer`` (sigmoid, hinge, ipo: length-normalised as TRL does; its ``sft``
term as ``pref_ftx``), MindSpeed-LLM's conservative DPO (``dpo_label_smoothing`` on sigmoid) and LLaMA-Factory's
reference-free ``simpo`` and ``orpo`` (average per-token log-probs). Parity with TRL is a test.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F

from engine.contract.constants import IGNORE_INDEX, REFERENCE_FREE_LOSSES

LossType = Literal["sigmoid", "hinge", "ipo", "simpo", "orpo"]
REFERENCE_FREE = REFERENCE_FREE_LOSSES


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(h_i @ W^T)[y_i] for each row, in fp32 (fp64 for fp64 inputs); backward recomputes the logits
    chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, into_grad):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        lse = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows] @ weight.t()).to(acc)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            out[rows] = logits.gather(1, labels[rows, None])[:, 0] - lse[rows]
            del logits  # freed before the next chunk's: one (chunk, V) buffer at a time, not two
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_size = chunk_size
        ctx.into_grad = into_grad and weight.is_leaf
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_grad_buffer(weight, lse.dtype, ctx.into_grad)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            g = _chunk_grads(
                hidden[rows], weight, labels[rows], lse[rows], grad_out[rows], grad_weight, grad_hidden is not None
            )
            if grad_hidden is not None and g is not None:
                grad_hidden[rows] = g.to(hidden.dtype)
        if grad_weight is None or grad_weight is weight.grad:
            return grad_hidden, None, None, None, None  # already in weight.grad
        if ctx.into_grad:  # a .grad of another dtype (bf16 parameters): add the fp32 sum once, rounded
            weight.grad.add_(grad_weight.to(weight.dtype))
            return grad_hidden, None, None, None, None
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


BACKWARD_VOCAB_SPLIT = 4  # vocabulary slices a chunk's backward walks: (chunk, V / 4) of d_logits at a time


def _chunk_grads(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_weight: torch.Tensor | None,
    need_hidden: bool,
) -> torch.Tensor | None:
    """One chunk's backward: its rows' hidden gradient (returned in fp32 with ``need_hidden``) and the head's gradient added into
    ``grad_weight``, a vocabulary slice at a time. Backward is a training step's peak (every activation, the (V, H)
    head gradient and this buffer at once): a slice's d_logits is a quarter of the chunk's (39 MB, not 155, at 256 ×
    151,936), and each slice of W is still read once per chunk."""
    acc = lse.dtype
    hw = h.to(acc)
    vocab = weight.shape[0]
    width = -(-vocab // BACKWARD_VOCAB_SPLIT)
    grad_h = torch.zeros((h.shape[0], weight.shape[1]), dtype=acc, device=h.device) if need_hidden else None
    for first in range(0, vocab, width):
        w = weight[first : first + width]
        # d logp / d logits = onehot(y) - softmax, scaled by each row's upstream gradient; in place over the slice's
        # one buffer: its logits become -softmax without a temporary
        d_logits = (h @ w.t()).to(acc).sub_(lse[:, None]).exp_().neg_()
        # the one-hot's 1 where a row's label falls in this slice, 0 added elsewhere: no host sync (a nonzero() would
        # wait for the device at every slice)
        inside = ((labels >= first) & (labels < first + d_logits.shape[1])).to(acc)
        d_logits.scatter_add_(1, (labels - first).clamp(0, d_logits.shape[1] - 1)[:, None], inside[:, None])
        d_logits *= grad_out[:, None]
        if grad_h is not None:
            grad_h.addmm_(d_logits, w.to(acc))
        if grad_weight is not None:
            grad_weight[first : first + width].addmm_(d_logits.t(), hw)  # in place: no second (V, H) buffer
        del d_logits  # freed before the next slice's
    return grad_h


def _weight_grad_buffer(weight: torch.Tensor, dtype: torch.dtype, into_grad: bool) -> torch.Tensor:
    """Where backward sums the head's (V, H) gradient. ``into_grad``: straight into ``weight.grad`` (created if
    absent), as Megatron's ``gradient_accumulation_fusion`` writes into ``main_grad``: with a tied embedding the
    gradient returned to autograd would wait in its buffer through the whole backward for the embedding's (the
    same parameter, used last), one (V, H) tensor more at the step's peak. Only for ``.backward()`` (``.grad``
    is the destination); ``autograd.grad`` callers leave it off."""
    if into_grad:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        if weight.grad.dtype == dtype:
            return weight.grad
    return torch.zeros(weight.shape, dtype=dtype, device=weight.device)


def sequence_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 256,
    into_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (B, T, H) final-norm states, weight (V, H) the head, labels (B, T) the next token at each position or
    ``IGNORE_INDEX`` -> (summed log-probs (B,) in fp32 or fp64, labelled tokens (B,)). Only labelled rows reach the
    head. ``into_grad``: backward adds the head's gradient to ``weight.grad`` itself (``_weight_grad_buffer``)."""
    b, t, h = hidden.shape
    flat = labels.reshape(-1)
    keep = (flat != IGNORE_INDEX).nonzero()[:, 0]
    rows = hidden.reshape(-1, h).index_select(0, keep)
    token_logps = _TokenLogprobs.apply(rows, weight, flat[keep], chunk_size, into_grad)
    seq = torch.div(keep, t, rounding_mode="floor")
    sums = torch.zeros(b, dtype=token_logps.dtype, device=hidden.device).index_add(0, seq, token_logps)
    return sums, torch.bincount(seq, minlength=b)


def row_logit_sums(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's logits summed over its labelled positions and the whole vocabulary, (B,) fp32, without forming a
    logit: a position's logits sum to ``h · Σ_v W_v``. Divided by (labelled tokens × vocabulary) it is TRL's
    ``logits/chosen`` / ``logits/rejected``. Not differentiated (a reported figure)."""
    b, t, h = hidden.shape
    flat = labels.reshape(-1)
    keep = (flat != IGNORE_INDEX).nonzero()[:, 0]
    with torch.no_grad():
        per_token = hidden.reshape(-1, h).index_select(0, keep).float() @ weight.float().sum(0)
        seq = torch.div(keep, t, rounding_mode="floor")
        return torch.zeros(b, dtype=torch.float32, device=hidden.device).index_add(0, seq, per_token)


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """The spec's preference settings (MindSpeed's names; ``simpo_gamma`` as LLaMA-Factory names it)."""

    loss_type: LossType = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid only: the probability a pair's preference is flipped (cDPO)
    pref_ftx: float = 0.0  # weight of the SFT loss on the chosen answers
    simpo_gamma: float = 0.5  # SimPO's target reward margin


@dataclasses.dataclass
class PairLogps:
    """Per-pair summed log-probs and labelled-token counts; ``ref_*`` None for reference-free losses."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None


def preference_loss(cfg: PreferenceConfig, p: PairLogps) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-pair loss (P,), per-pair metrics: rewards of chosen and rejected, their margin, accuracy)."""
    n_c, n_r = p.chosen_tokens.clamp(min=1), p.rejected_tokens.clamp(min=1)
    if cfg.loss_type in REFERENCE_FREE:
        avg_c, avg_r = p.chosen / n_c, p.rejected / n_r
        loss = _simpo(cfg, avg_c, avg_r) if cfg.loss_type == "simpo" else _orpo(cfg, avg_c, avg_r)
        reward_c, reward_r = cfg.beta * avg_c.detach(), cfg.beta * avg_r.detach()
    else:
        if p.ref_chosen is None or p.ref_rejected is None:
            raise ValueError(f"dpo_loss_type: {cfg.loss_type} needs the reference model's log-probs")
        ratio_c, ratio_r = p.chosen - p.ref_chosen, p.rejected - p.ref_rejected
        loss = _dpo(cfg, ratio_c, ratio_r, n_c, n_r)
        reward_c, reward_r = cfg.beta * ratio_c.detach(), cfg.beta * ratio_r.detach()
    if cfg.pref_ftx:
        # TRL's "sft" term: the mean -log p over every chosen token of the batch, the same for each pair
        loss = loss + cfg.pref_ftx * (-p.chosen.sum() / p.chosen_tokens.sum().clamp(min=1))
    metrics = {
        "rewards_chosen": reward_c,
        "rewards_rejected": reward_r,
        "rewards_margin": reward_c - reward_r,
        "rewards_accuracy": (reward_c > reward_r).float(),
    }
    return loss, metrics


def _dpo(
    cfg: PreferenceConfig, ratio_c: torch.Tensor, ratio_r: torch.Tensor, n_c: torch.Tensor, n_r: torch.Tensor
) -> torch.Tensor:
    delta = ratio_c - ratio_r
    if cfg.loss_type == "sigmoid":
        ls = cfg.label_smoothing
        return -F.logsigmoid(cfg.beta * delta) * (1 - ls) - F.logsigmoid(-cfg.beta * delta) * ls
    if cfg.loss_type == "hinge":
        return torch.relu(1 - cfg.beta * delta)
    # ipo: per-token averages, so beta means the same at every completion length (TRL, with the IPO authors)
    return (ratio_c / n_c - ratio_r / n_r - 1 / (2 * cfg.beta)) ** 2


def _simpo(cfg: PreferenceConfig, avg_c: torch.Tensor, avg_r: torch.Tensor) -> torch.Tensor:
    return -F.logsigmoid(cfg.beta * (avg_c - avg_r) - cfg.simpo_gamma)


def _orpo(cfg: PreferenceConfig, avg_c: torch.Tensor, avg_r: torch.Tensor) -> torch.Tensor:
    """SFT on the chosen answer plus beta × the odds-ratio loss (Hong et al.; LLaMA-Factory's ``orpo``)."""
    log_odds = (avg_c - avg_r) - (torch.log1p(-torch.exp(avg_c)) - torch.log1p(-torch.exp(avg_r)))
    return -avg_c - cfg.beta * F.logsigmoid(log_odds)
