"""Training rows in token counts: how the trainer cuts a dataset into rows and samples, and how wide it pads them.

The trainer (``engine.train.data``, ``engine.train.batches``) and the memory planner (``engine.contract.plan.data_shape``, at
submission, torch-free) both read their rules here, so the planner sizes micro-batches exactly as the engine forms
them, from the ``.idx`` files alone (plus our small ``_pack_boundaries`` index of pre-packed rows), without reading a
token. numpy only.

- A sample feeds ``min(len, seq_length) - 1`` tokens (truncated, then the next-token shift drops one).
- A pretraining document longer than ``seq_length`` is several rows: ``seq_length`` windows overlapping by one.
- A pre-packed instruction row holds the sub-samples its boundaries name (one sample when it has none; MindSpeed
  neat-pack rows without our boundaries file are split by their attention mask at run time, which the index does not
  show: they are sized as one sample per row, and the engine refuses a micro-batch beyond its plan).
- A preference row is a pair: chosen and rejected, two samples.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from engine.contract.indexed import (
    PAIRWISE_FIELDS,
    IndexedDataset,
    boundaries_prefix,
    instruction_prefix,
)
from engine.contract.runfiles import BadInput


def dataset_exists(prefix: str) -> bool:
    """Both files of a Megatron dataset (``<prefix>.idx`` and ``<prefix>.bin``) are there."""
    return os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")


def text_prefix(prefix: str) -> str:
    """The pretraining dataset a ``data_path`` prefix names: itself, or ``<prefix>_text_document``."""
    return prefix if dataset_exists(prefix) else prefix + "_text_document"


def text_windows(lengths: np.ndarray, seq_length: int) -> np.ndarray | None:
    """First row of each document when some are cut into ``seq_length`` windows overlapping by one (the last entry
    is the row count); None when every document fits in one row."""
    if not len(lengths) or int(lengths.max()) <= seq_length:
        return None
    windows = np.maximum(1, -(-(lengths.astype(np.int64) - 1) // window_step(seq_length)))
    return np.concatenate(([0], np.cumsum(windows)))


def window_step(seq_length: int) -> int:
    return max(1, seq_length - 1)


def fed_tokens(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """Tokens each sample feeds the model: truncated to ``seq_length``, less the one the label shift drops."""
    return np.maximum(np.minimum(lengths.astype(np.int64), seq_length) - 1, 0)


def split_counts(total: int, split: str) -> tuple[int, int]:
    """(train, validation) sample counts of ``total`` for ``split`` "a,b,c" (weights; the rest is the test share)."""
    parts = [float(p) for p in split.replace("/", ",").split(",") if p.strip()]
    if not parts or sum(parts) <= 0 or parts[0] <= 0 or any(p < 0 for p in parts):
        raise BadInput(f"split: {split!r} leaves no training data", "split")
    cumulative = [sum(parts[: i + 1]) / sum(parts) for i in range(min(len(parts), 2))]
    train = int(total * cumulative[0])
    valid = int(total * cumulative[1]) - train if len(cumulative) > 1 else 0
    return train, valid


def padded_width(lens: Sequence[int], seq_length: int, to_longest: bool) -> int:
    """Row width of a padded micro-batch: its longest sample (``variable_seq_lengths``) or ``seq_length - 1``."""
    return max(lens, default=0) if to_longest else seq_length - 1


@dataclasses.dataclass(frozen=True)
class RowLengths:
    """Per training row: its samples, the tokens they feed together, and the longest one's."""

    count: np.ndarray
    total: np.ndarray
    longest: np.ndarray

    @classmethod
    def single(cls, fed: np.ndarray) -> RowLengths:
        return cls(np.ones_like(fed), fed, fed)

    @classmethod
    def concat(cls, parts: Sequence[RowLengths]) -> RowLengths:
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)))

    def head(self, n: int) -> RowLengths:
        return RowLengths(self.count[:n], self.total[:n], self.longest[:n])


def _pairs(prefix: str, seq_length: int) -> RowLengths:
    chosen, rejected = (
        fed_tokens(IndexedDataset(instruction_prefix(prefix, f)).sequence_lengths, seq_length)
        for f in PAIRWISE_FIELDS[0::2]
    )
    return RowLengths(np.full_like(chosen, 2), chosen + rejected, np.maximum(chosen, rejected))


def _packed_rows(bounds: IndexedDataset, seq_length: int) -> RowLengths:
    """Rows cut by their end offsets: ``bounds`` holds one int64 end per sub-sample, one sequence per row."""
    counts = bounds.sequence_lengths.astype(np.int64)
    ends = bounds.flat().astype(np.int64)
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    starts = np.concatenate(([0], ends[:-1]))
    starts[firsts[counts > 0]] = 0  # each row's first sub-sample starts at 0
    fed = fed_tokens(ends - starts, seq_length)
    row = np.repeat(np.arange(len(counts)), counts)
    total = np.bincount(row, weights=fed, minlength=len(counts)).astype(np.int64)
    longest = np.zeros(len(counts), np.int64)
    np.maximum.at(longest, row, fed)
    return RowLengths(counts, total, longest)


def _text_rows(prefix: str, seq_length: int) -> RowLengths:
    lengths = IndexedDataset(text_prefix(prefix)).sequence_lengths.astype(np.int64)
    starts = text_windows(lengths, seq_length)
    if starts is None:
        return RowLengths.single(fed_tokens(lengths, seq_length))
    doc = np.repeat(np.arange(len(lengths)), np.diff(starts))
    window = np.arange(int(starts[-1])) - starts[doc]
    return RowLengths.single(fed_tokens(lengths[doc] - window * window_step(seq_length), seq_length))


def dataset_rows(prefix: str, seq_length: int, pairwise: bool) -> RowLengths:
    """The rows of one ``data_path`` prefix as the trainer reads them (``engine.train.data``). Raises ``ValueError``
    or ``OSError`` when the files are not a Megatron dataset."""
    if pairwise:
        return _pairs(prefix, seq_length)
    if dataset_exists(instruction_prefix(prefix, "input_ids")):
        bounds = boundaries_prefix(prefix)
        if dataset_exists(bounds):
            return _packed_rows(IndexedDataset(bounds), seq_length)
        lengths = IndexedDataset(instruction_prefix(prefix, "input_ids")).sequence_lengths
        return RowLengths.single(fed_tokens(lengths, seq_length))
    return _text_rows(prefix, seq_length)
