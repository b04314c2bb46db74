"""Packing samples into fixed-length rows (MindSpeed ``--pack`` / ``--neat-pack``, LLaMA-Factory's greedy knapsack).

Samples are grouped within a window of consecutive samples (memory stays bounded; MindSpeed also packs per
preprocessing batch) by greedy knapsack into ``capacity = seq_length - 1`` tokens, then each row is padded to exactly
``seq_length``: input ids with the pad id, labels with -100, attention mask with 1 (``--pack``) or, under neat
packing, the 1-based sub-sample index per token and 0 on padding. Every row also carries its sub-sample end offsets
(``boundaries``), so the trainer can restart position ids and keep attention inside each sample either way.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from engine.contract.constants import IGNORE_INDEX


def greedy_knapsack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of total ≤ ``capacity``: each bin repeatedly takes the longest sample
    that still fits (LLaMA-Factory ``greedy_knapsack``); bins come out in creation order, longest first.
    Every length must be ≤ ``capacity`` (over-long samples are handled before packing)."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"a sample is longer than the packing capacity {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    keys = [lengths[i] for i in order]
    bins: list[list[int]] = []
    while order:
        remaining, current = capacity, []
        while True:
            pos = bisect.bisect_right(keys, remaining) - 1
            if pos < 0:
                break
            remaining -= keys.pop(pos)
            current.append(order.pop(pos))
        bins.append(current)
    return bins


@dataclass(frozen=True)
class PackedRow:
    input_ids: np.ndarray
    labels: np.ndarray
    attention_mask: np.ndarray
    boundaries: np.ndarray  # int32 end offsets of the sub-samples (padding excluded)


def pack_rows(
    samples: list[tuple[np.ndarray, np.ndarray]], seq_length: int, pad_id: int, neat: bool
) -> list[PackedRow]:
    """Pack ``(input_ids, labels)`` samples (each ≤ ``seq_length - 1`` tokens) into padded rows of ``seq_length``."""
    rows = []
    for group in greedy_knapsack([len(ids) for ids, _ in samples], seq_length - 1):
        parts = [samples[i] for i in group]
        lengths = np.asarray([len(ids) for ids, _ in parts], dtype=np.int32)
        used = int(lengths.sum())
        pad = seq_length - used
        ids = np.concatenate([p[0] for p in parts] + [np.full(pad, pad_id, np.int32)])
        labels = np.concatenate([p[1] for p in parts] + [np.full(pad, IGNORE_INDEX, np.int32)])
        if neat:
            mask = np.concatenate(
                [np.repeat(np.arange(1, len(parts) + 1, dtype=np.int32), lengths), np.zeros(pad, np.int32)]
            )
        else:
            mask = np.ones(seq_length, np.int32)
        rows.append(PackedRow(ids.astype(np.int32), labels.astype(np.int32), mask, np.cumsum(lengths, dtype=np.int32)))
    return rows
