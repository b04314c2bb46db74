"""Packing (greedy knapsack, padded rows, boundaries) and the resumable data-parallel sampler."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from engine.contract.sampler import DistributedSampler
from engine.data.packing import greedy_knapsack, pack_rows


def test_knapsack_fills_bins_without_exceeding_capacity():
    lengths = [7, 3, 5, 2, 9, 1, 4]
    bins = greedy_knapsack(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert bins[0] == [4, 5]  # longest first, then the longest that still fits
    with pytest.raises(ValueError, match="longer than the packing capacity"):
        greedy_knapsack([11], 10)


@pytest.mark.parametrize("neat", [False, True])
def test_rows_are_padded_and_keep_boundaries(neat):
    samples = [
        (np.arange(1, 4, dtype=np.int32), np.asarray([-100, 2, 3], np.int32)),
        (np.asarray([7, 8], np.int32), np.asarray([-100, 8], np.int32)),
    ]
    (row,) = pack_rows(samples, seq_length=8, pad_id=0, neat=neat)
    assert row.input_ids.tolist() == [1, 2, 3, 7, 8, 0, 0, 0]
    assert row.labels.tolist() == [-100, 2, 3, -100, 8, -100, -100, -100]
    assert row.boundaries.tolist() == [3, 5]
    assert row.attention_mask.tolist() == ([1, 1, 1, 2, 2, 0, 0, 0] if neat else [1] * 8)


def take(sampler, steps):
    return list(itertools.islice(iter(sampler), steps))


def test_sampler_is_seeded_and_covers_each_epoch_once():
    a = take(DistributedSampler(10, micro_batch_size=2, seed=7), 5)
    assert a == take(DistributedSampler(10, micro_batch_size=2, seed=7), 5)
    assert sorted(i for b in a for i in b) == list(range(10))
    assert a != take(DistributedSampler(10, micro_batch_size=2, seed=8), 5)
    assert take(DistributedSampler(4, micro_batch_size=2, shuffle=False), 3) == [[0, 1], [2, 3], [0, 1]]


def test_ranks_split_each_step_and_union_equals_single_rank():
    single = take(DistributedSampler(12, micro_batch_size=4, seed=1), 3)
    r0 = take(DistributedSampler(12, micro_batch_size=2, dp_rank=0, dp_size=2, seed=1), 3)
    r1 = take(DistributedSampler(12, micro_batch_size=2, dp_rank=1, dp_size=2, seed=1), 3)
    assert [a + b for a, b in zip(r0, r1)] == single


def test_restart_at_consumed_samples_continues_where_it_stopped():
    full = [i for b in take(DistributedSampler(10, micro_batch_size=2, dp_size=1, seed=3), 12) for i in b]
    sampler = DistributedSampler(10, micro_batch_size=2, seed=3)
    take(sampler, 5)
    assert sampler.consumed_samples == 10
    resumed = [i for b in take(DistributedSampler(10, micro_batch_size=2, seed=3, consumed_samples=10), 7) for i in b]
    assert resumed == full[10:]  # sample N+1 onwards, across the epoch boundary too
    with pytest.raises(ValueError, match="consumed_samples"):
        DistributedSampler(10, micro_batch_size=2, dp_size=2, consumed_samples=3)
