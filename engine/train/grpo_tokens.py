"""Stage grpo's training tokens: the micro-batch of prompt + completion rows, each completion token's log-prob (and
entropy) under the tempered distribution through the chunked head, and the micro-batch's share of the surrogate loss
(``engine.train.grpo_loss``'s formulas) with the step's stats. Used per micro-batch (``grpo_loss``) and on a
pipeline's last stage (``engine.train.grpo_pipeline``), which has the final hidden states only.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from engine.contract.constants import IGNORE_INDEX
from engine.contract.spec import TrainSpec
from engine.model.decoder_lm import decoder_lm
from engine.parallel.context_parallel import shard_index, shard_multiple
from engine.parallel.tensor_parallel import vocab_parallel_token_entropy, vocab_parallel_token_logprobs
from engine.train.batches import MicroBatch, context_shard
from engine.train.grpo_loss import LossType, SurrogateConfig, aggregate
from engine.train.grpo_loss import token_terms as surrogate_terms
from engine.train.metrics import PER
from engine.train.preference import _TokenLogprobs
from engine.train.step_runner import Losses, MicroBatchLoss

STEP_STATS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclasses.dataclass
class GRPOMicroBatch(MicroBatch):
    """A micro-batch of prompt + completion rows; per completion token (in ``loss_index`` order): its sequence in
    the micro-batch, advantage, mask (0: a truncated completion under ``mask_truncated_completions``), and the old
    policy's / reference's log-probs when the step needs them; per sequence, its masked completion tokens
    (``seq_tokens``: all of them, also where a CP rank holds only some)."""

    sequences: int = 0
    token_seq: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_token_logps: torch.Tensor | None = None
    seq_tokens: torch.Tensor | None = None

    def to(self, device: torch.device) -> GRPOMicroBatch:
        moved = super().to(device)

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return dataclasses.replace(
            cast(GRPOMicroBatch, moved),
            token_seq=move(self.token_seq),
            advantages=move(self.advantages),
            mask=move(self.mask),
            old_logps=move(self.old_logps),
            ref_token_logps=move(self.ref_token_logps),
            seq_tokens=move(self.seq_tokens),
        )


def grpo_context_shard(g: GRPOMicroBatch, ring: int, ulysses: int, rank: int) -> GRPOMicroBatch:
    """This context-parallel rank's share of ``g`` (``engine.train.batches.context_shard``) with the fields of the
    completion tokens it holds, in its own loss order; ``advantages`` and ``seq_tokens`` stay whole (per sequence),
    so the CP ranks' numerators add up to ``g``'s. Cut before the old and reference log-probs, which are the shard's."""
    if g.old_logps is not None or g.ref_token_logps is not None:
        raise ValueError("grpo_context_shard: shard the micro-batch before its old and reference log-probs")
    assert g.token_seq is not None and g.mask is not None
    local = context_shard(g, ring, ulysses, rank)
    labels = g.labels.numpy()
    rows, t = labels.shape
    multiple = shard_multiple(ring, ulysses)
    labelled = labels != IGNORE_INDEX
    # each labelled position's place among the micro-batch's completion tokens (row-major, as ``loss_index``)
    ordinal = np.full((rows, -(-t // multiple) * multiple), -1, dtype=np.int64)
    ordinal[:, :t] = np.where(labelled, np.cumsum(labelled.reshape(-1)).reshape(rows, t) - 1, -1)
    here = ordinal[:, shard_index(ordinal.shape[1], ring, ulysses, rank)].reshape(-1)
    picks = torch.from_numpy(here[here >= 0])
    if picks.numel() != local.num_loss_tokens:
        raise RuntimeError("grpo_context_shard: the shard's labelled tokens are not the picked completion tokens")
    fields = {f.name: getattr(local, f.name) for f in dataclasses.fields(MicroBatch)}
    return GRPOMicroBatch(
        **fields,
        sequences=g.sequences,
        token_seq=g.token_seq[picks],
        advantages=g.advantages,
        mask=g.mask[picks],
        seq_tokens=g.seq_tokens,
    )


def token_logps(
    model: nn.Module, mb: MicroBatch, chunk_size: int, temperature: float, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each completion token's log-prob under logits / temperature (fp32, differentiable), and with ``entropy``
    each position's entropy of that distribution (detached), chunk by chunk through the head (vocab-parallel
    under TP: the same figures on every TP rank)."""
    hidden = model(
        mb.input_ids, position_ids=mb.position_ids, segment_ids=mb.segment_ids, return_hidden=True, counted=mb.counted
    )
    head = decoder_lm(model).output_weight()
    rows = TokenRows(mb.labels, mb.loss_index, mb.loss_labels)
    # into .grad while training (a tied head's gradient does not wait beside the embedding's: one (V, H) less)
    return hidden_token_logps(hidden, head, rows, chunk_size, temperature, entropy, torch.is_grad_enabled())


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """The labelled tokens of a micro-batch's (B, T) ``labels``: their flat positions and labels."""

    labels: torch.Tensor
    index: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def of(cls, labels: torch.Tensor) -> TokenRows:
        """Found from ``labels`` (a pipeline's last stage gets the rows padded to the pipeline's width)."""
        flat = labels.reshape(-1)
        index = (flat != IGNORE_INDEX).nonzero().squeeze(1)
        return cls(labels, index, flat.index_select(0, index))


def hidden_token_logps(
    hidden: torch.Tensor,
    head: torch.Tensor,
    rows: TokenRows,
    chunk_size: int,
    temperature: float,
    entropy: bool,
    into_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logps`` from the final hidden states (a pipeline's last stage has nothing else). ``into_grad``: a
    replicated head's gradient goes straight into its ``.grad``; never under a pipeline schedule
    (``engine.train.dpo.rows_from_hidden`` says why)."""
    if temperature != 1.0:
        hidden = hidden / temperature
    if isinstance(head, DTensor):
        logps = vocab_parallel_token_logprobs(hidden, head, rows.labels, chunk_size, rows.index)
        ent = vocab_parallel_token_entropy(hidden, head, rows.index, chunk_size) if entropy else None
        return logps, ent
    flat = hidden.flatten(0, 1).index_select(0, rows.index)
    if not entropy:
        return _TokenLogprobs.apply(flat, head, rows.targets, chunk_size, into_grad), None
    logps, ent = _TokenLogprobsEntropy.apply(flat, head, rows.targets, chunk_size, into_grad)
    return logps, ent


class _TokenLogprobsEntropy(_TokenLogprobs):
    """``_TokenLogprobs`` that also returns each row's entropy (detached) from the same chunks' logits: one pass
    through the head instead of two. Backward is ``_TokenLogprobs``' (the entropy takes no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, into_grad):
        acc = torch.promote_types(hidden.dtype, torch.float32)
        out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        lse, ent = torch.empty_like(out), torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows] @ weight.t()).to(acc)
            lse[rows] = torch.logsumexp(logits, dim=-1)
            out[rows] = logits.gather(1, labels[rows, None])[:, 0] - lse[rows]
            _entropy_into(ent[rows], logits, lse[rows])
            del logits  # freed before the next chunk's: one (chunk, V) buffer at a time
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk_size = chunk_size
        ctx.into_grad = into_grad and weight.is_leaf
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent):  # type: ignore[override]
        return _TokenLogprobs.backward(ctx, grad_out)


ENTROPY_ROWS = 16  # rows per temporary of the entropy's p · logits: (16, V) beside the chunk's logits, not (chunk, V)


def _entropy_into(out: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor) -> None:
    """H = lse - sum(p · logits), p = exp(logits - lse), per row of a chunk's logits into ``out``, a few rows at a
    time: a whole chunk's p would be a second (chunk, V) fp32 buffer at the forward's peak (155 MB at 256 rows)."""
    for first in range(0, logits.shape[0], ENTROPY_ROWS):
        rows = slice(first, first + ENTROPY_ROWS)
        part = logits[rows]
        out[rows] = lse[rows] - (part - lse[rows, None]).exp_().mul_(part).sum(dim=-1)


def grpo_loss(spec: TrainSpec) -> MicroBatchLoss:
    """The micro-batch loss of stage grpo: the numerator of ``loss_type``'s aggregation, with the step's stats as
    token sums over their counts (``x`` and ``x#per``)."""
    cfg, chunk, temperature = surrogate_config(spec), spec.cross_entropy_chunk_size, spec.temperature

    def loss(model: nn.Module, mb: MicroBatch) -> Losses:
        g = cast(GRPOMicroBatch, mb)
        logp, ent = token_logps(model, g, chunk, temperature, entropy=True)
        assert ent is not None
        return surrogate_losses(cfg, spec.loss_type, g, logp, ent)

    return loss


def surrogate_config(spec: TrainSpec) -> SurrogateConfig:
    return SurrogateConfig(spec.beta, spec.epsilon, spec.epsilon_high or spec.epsilon, spec.kl_clamp)


def surrogate_losses(
    cfg: SurrogateConfig, loss_type: LossType, g: GRPOMicroBatch, logp: torch.Tensor, ent: torch.Tensor
) -> Losses:
    """One micro-batch's numerator of ``loss_type``'s aggregation from its tokens' log-probs and entropies, and the
    step's stats as token sums (``x``) over their counts (``x#per``)."""
    assert g.token_seq is not None and g.advantages is not None and g.mask is not None
    old = logp.detach() if g.old_logps is None else g.old_logps
    adv = g.advantages[g.token_seq].to(logp.dtype)
    terms = surrogate_terms(cfg, logp, old, adv, g.ref_token_logps)
    numerator = aggregate(loss_type, terms.loss, g.mask.to(logp.dtype), g.token_seq, g.sequences, g.seq_tokens)
    m = g.mask.float()
    tokens = m.sum()
    zero = torch.zeros((), device=logp.device)
    stats = {
        "kl": zero if terms.kl is None else (terms.kl.float() * m).sum(),
        "entropy": (ent * m).sum(),
        "clip_ratio/low_mean": (terms.low_clipped.float() * m).sum(),
        "clip_ratio/high_mean": (terms.high_clipped.float() * m).sum(),
        "clip_ratio/region_mean": ((terms.low_clipped | terms.high_clipped).float() * m).sum(),
    }
    stats.update({f"{name}{PER}": tokens for name in STEP_STATS})
    return Losses(numerator.float(), stats=stats)
