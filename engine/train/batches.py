"""Micro-batches from tokenized samples: padding-free packing or padded rows, labels shifted per sample.

Packed (default): the micro-batch's samples are concatenated into one row; ``segment_ids`` keep attention inside each
sample and ``position_ids`` restart at 0 per sample, so the model computes nothing on padding and no sample sees
another. Padded: one row per sample, right-padded to the micro-batch's longest sample (``variable_seq_lengths``) or
to ``seq_length``; right padding under a causal mask needs no attention mask.

Labels are shifted inside each sample (token t predicts label t+1) so packing never makes one sample predict the
next one's first token. ``loss_index`` lists the flat positions with a real label, computed here on the host so the
trainer gathers those hidden states without a device->host sync (boolean masking on a device would sync).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from engine.contract.constants import IGNORE_INDEX, PAD_ID
from engine.contract.lengths import padded_width
from engine.parallel.context_parallel import shard_index, shard_multiple
from engine.parallel.pipeline_parallel import WIDTH_BUCKET


@dataclasses.dataclass
class Sample:
    """One tokenized sample: ``input_ids`` and aligned ``labels`` (IGNORE_INDEX where there is no loss)."""

    input_ids: np.ndarray
    labels: np.ndarray
    ref_logp: float | None = None  # stage dpo, precomputed: the reference's summed log-prob of this answer


@dataclasses.dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (B, T) long
    position_ids: torch.Tensor  # (B, T) long
    segment_ids: torch.Tensor | None  # (B, T) int32 when several samples share a row
    labels: torch.Tensor  # (B, T) long, IGNORE_INDEX where no loss
    loss_index: torch.Tensor  # (N,) flat positions in B*T with a label
    loss_labels: torch.Tensor  # (N,)
    seq_lens: list[int]  # real tokens per sample (after the shift)
    pairs: int = 0  # preference data: rows [chosen of each pair; rejected of each pair], ``pairs`` of each
    ref_logps: torch.Tensor | None = None  # (rows,) fp32: the reference's precomputed row log-probs, when stored
    counted: torch.Tensor | None = None  # (T,) bool: tokens MoE routing counts, when ``context_shard`` padded rows

    @property
    def loss_units(self) -> int:
        """What the step's loss is averaged over: pairs for preference data, else labelled tokens."""
        return self.pairs or self.num_loss_tokens

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) input tokens."""
        return sum(self.seq_lens)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_index.numel())

    def to(self, device: torch.device) -> MicroBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return dataclasses.replace(
            self,
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            segment_ids=None if self.segment_ids is None else move(self.segment_ids),
            labels=move(self.labels),
            loss_index=move(self.loss_index),
            loss_labels=move(self.loss_labels),
            ref_logps=None if self.ref_logps is None else move(self.ref_logps),
            counted=None if self.counted is None else move(self.counted),
        )


def shift(sample: Sample, seq_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, targets) of a sample truncated to ``seq_length`` tokens: targets[t] = labels[t + 1]."""
    ids = np.asarray(sample.input_ids[:seq_length], dtype=np.int64)
    labels = np.asarray(sample.labels[:seq_length], dtype=np.int64)
    return ids[:-1], labels[1:]


def _finish(
    ids: np.ndarray, pos: np.ndarray, seg: np.ndarray | None, labels: np.ndarray, lens: list[int]
) -> MicroBatch:
    flat = labels.reshape(-1)
    index = np.flatnonzero(flat != IGNORE_INDEX)
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(pos),
        segment_ids=None if seg is None else torch.from_numpy(seg),
        labels=torch.from_numpy(labels),
        loss_index=torch.from_numpy(index),
        loss_labels=torch.from_numpy(flat[index]),
        seq_lens=lens,
    )


def pack(samples: Sequence[Sample], seq_length: int) -> MicroBatch:
    """All samples in one row (B=1) with per-sample segment ids and positions."""
    parts = [shift(s, seq_length) for s in samples]
    parts = [p for p in parts if len(p[0])]
    if not parts:
        raise ValueError("every sample of the micro-batch is shorter than 2 tokens")
    lens = [len(t) for t, _ in parts]
    ids = np.concatenate([t for t, _ in parts])[None]
    labels = np.concatenate([lab for _, lab in parts])[None]
    pos = np.concatenate([np.arange(n) for n in lens])[None]
    seg = np.repeat(np.arange(len(lens), dtype=np.int32), lens)[None] if len(lens) > 1 else None
    return _finish(ids, pos, seg, labels, lens)


def pad(samples: Sequence[Sample], seq_length: int, to_longest: bool) -> MicroBatch:
    """One right-padded row per sample: to the longest sample, or to ``seq_length - 1`` (after the shift)."""
    parts = [shift(s, seq_length) for s in samples]
    lens = [len(t) for t, _ in parts]
    width = padded_width(lens, seq_length, to_longest)
    ids = np.full((len(parts), width), PAD_ID, dtype=np.int64)
    labels = np.full((len(parts), width), IGNORE_INDEX, dtype=np.int64)
    for row, (tokens, targets) in enumerate(parts):
        ids[row, : len(tokens)] = tokens
        labels[row, : len(targets)] = targets
    pos = np.broadcast_to(np.arange(width), ids.shape).copy()
    return _finish(ids, pos, None, labels, lens)


def collate_pairs(samples: Sequence[Sample], seq_length: int, variable_seq_lengths: bool) -> MicroBatch:
    """Preference pairs ``[chosen_1, rejected_1, chosen_2, ...]`` as one padded batch ``[chosen; rejected]``, so
    both answers of every pair go through one forward (rows carry per-sequence sums: packing would merge them)."""
    chosen, rejected = samples[0::2], samples[1::2]
    rows = [*chosen, *rejected]
    stored = [s.ref_logp for s in rows]
    ref = None if None in stored else torch.tensor(stored, dtype=torch.float32)
    return dataclasses.replace(pad(rows, seq_length, variable_seq_lengths), pairs=len(chosen), ref_logps=ref)


def collate(samples: Sequence[Sample], seq_length: int, padding_free: bool, variable_seq_lengths: bool) -> MicroBatch:
    return pack(samples, seq_length) if padding_free else pad(samples, seq_length, variable_seq_lengths)


def context_pipeline_width(batches: Sequence[MicroBatch], ring: int, ulysses: int) -> int:
    """The one row width of a step's micro-batches under PP × CP: the longest, rounded up to a multiple of
    ``WIDTH_BUCKET`` (few widths, few pipeline schedules) and of the CP shares (head/tail chunks alike on every rank)."""
    unit = math.lcm(shard_multiple(ring, ulysses), WIDTH_BUCKET)
    longest = max(mb.input_ids.shape[1] for mb in batches)
    return -(-longest // unit) * unit


def context_shard(mb: MicroBatch, ring: int, ulysses: int, rank: int, width: int | None = None) -> MicroBatch:
    """This context-parallel rank's share of ``mb`` (CP = ring × ulysses): the tokens
    ``engine.parallel.context_parallel.shard_index`` gives it of every row (rows padded at the end to an equal share
    per rank: pad tokens, no label, positions continuing, the row's last segment), with their labels, positions and
    loss positions; ``segment_ids`` stay whole, since attention sees every token. The real-token lengths stay on CP
    rank 0 only, so sums over the DP × CP ranks count each sample once; ``counted`` marks the tokens that are not
    this padding (MoE routing figures and the load-balancing loss skip it). ``width``: pad every row to it instead
    (a pipeline's micro-batches share one width: padding a shard's end would put pad tokens among real ones)."""
    t = mb.input_ids.shape[1]
    multiple = shard_multiple(ring, ulysses)
    width = width or -(-t // multiple) * multiple
    if width % multiple or width < t:
        raise ValueError(f"context_shard: width {width} is below {t} tokens or not a multiple of {multiple}")
    extra = width - t
    ids = np.pad(mb.input_ids.numpy(), ((0, 0), (0, extra)), constant_values=PAD_ID)
    labels = np.pad(mb.labels.numpy(), ((0, 0), (0, extra)), constant_values=IGNORE_INDEX)
    pos = mb.position_ids.numpy()
    pos = np.concatenate([pos, pos[:, -1:] + np.arange(1, extra + 1)], axis=1)
    seg = None
    if mb.segment_ids is not None:
        s = mb.segment_ids.numpy()
        seg = torch.from_numpy(np.concatenate([s, np.repeat(s[:, -1:], extra, axis=1)], axis=1))
    part = shard_index(width, ring, ulysses, rank)
    local = _finish(ids[:, part], pos[:, part], None, labels[:, part], mb.seq_lens if rank == 0 else [])
    counted = torch.from_numpy(part < t) if extra else None  # this padding is CP's own: MoE routing skips it
    return dataclasses.replace(local, segment_ids=seg, pairs=mb.pairs, ref_logps=mb.ref_logps, counted=counted)
