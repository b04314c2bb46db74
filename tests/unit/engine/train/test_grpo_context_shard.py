"""Stage grpo under context parallelism: each CP rank's share of a micro-batch carries the sequence and mask of the
very completion tokens it holds, and the CP ranks' numerators of every loss_type add up to the whole micro-batch's
(grpo's per-sequence means and bnpo's micro-batch mean from whole counts, not a rank's own)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.contract.constants import IGNORE_INDEX
from engine.train.batches import MicroBatch, Sample, collate
from engine.train.grpo_loss import LossType, aggregate
from engine.train.grpo_tokens import GRPOMicroBatch, grpo_context_shard

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
COMPLETIONS = [[20, 21, 22, 23, 24], [25], [26, 27, 28], [29, 30, 31, 32, 33, 34, 35]]
KEEP = [1.0, 1.0, 0.0, 1.0]  # the third completion truncated and masked


def _micro_batch(padding_free: bool) -> GRPOMicroBatch:
    samples = [
        Sample(np.array(p + c), np.array([IGNORE_INDEX] * len(p) + c))
        for p, c in zip(PROMPTS, COMPLETIONS, strict=True)
    ]
    mb = collate(samples, 64, padding_free, variable_seq_lengths=True)
    counts = torch.tensor([len(c) for c in COMPLETIONS])
    seq = torch.repeat_interleave(torch.arange(len(COMPLETIONS)), counts)
    keep = torch.tensor(KEEP)
    fields = {name: getattr(mb, name) for name in MicroBatch.__dataclass_fields__}
    return GRPOMicroBatch(
        **fields, sequences=len(COMPLETIONS), token_seq=seq, advantages=torch.tensor([0.5, -1.0, 2.0, 0.25]),
        mask=keep[seq], seq_tokens=keep * counts,
    )  # fmt: skip


def _token_loss(mb: MicroBatch) -> torch.Tensor:
    """A loss per labelled token that depends on which token it is (its label and position), wherever it sits."""
    pos = mb.position_ids.reshape(-1)[mb.loss_index].double()
    return mb.loss_labels.double() * 0.1 + pos


def _numerator(loss_type: LossType, mb: GRPOMicroBatch, whole_counts: bool) -> float:
    """``mb``'s numerator of ``loss_type`` on ``_token_loss``; ``whole_counts``: with the sequences' whole counts."""
    assert mb.token_seq is not None and mb.mask is not None
    counts = mb.seq_tokens if whole_counts else None
    return float(aggregate(loss_type, _token_loss(mb), mb.mask.double(), mb.token_seq, mb.sequences, counts))


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize(("ring", "ulysses"), [(2, 1), (1, 2), (2, 2)])
def test_cp_ranks_numerators_add_up_to_the_micro_batchs(padding_free: bool, ring: int, ulysses: int) -> None:
    whole = _micro_batch(padding_free)
    shards = [grpo_context_shard(whole, ring, ulysses, rank) for rank in range(ring * ulysses)]
    assert sum(s.num_loss_tokens for s in shards) == whole.num_loss_tokens
    # each token's sequence and mask travel with it: the (label, sequence, mask) triples are the whole's, reordered

    def triples(mb: GRPOMicroBatch) -> list[tuple[int, int, float]]:
        assert mb.token_seq is not None and mb.mask is not None
        return list(zip(mb.loss_labels.tolist(), mb.token_seq.tolist(), mb.mask.tolist(), strict=True))

    assert sorted(t for s in shards for t in triples(s)) == sorted(triples(whole))
    loss_types: tuple[LossType, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
    for loss_type in loss_types:
        full = _numerator(loss_type, whole, True)
        assert sum(_numerator(loss_type, s, True) for s in shards) == pytest.approx(full, rel=1e-12), loss_type
        if loss_type == "grpo" and ring > 1:  # head/tail chunks split the rows: a rank's own counts would not add up
            assert abs(sum(_numerator(loss_type, s, False) for s in shards) - full) > 1e-3


def test_shard_refuses_log_probs_cut_from_the_whole_rows() -> None:
    mb = _micro_batch(False)
    mb.old_logps = torch.zeros(mb.num_loss_tokens)
    with pytest.raises(ValueError, match="before its old and reference log-probs"):
        grpo_context_shard(mb, 2, 1, 0)
