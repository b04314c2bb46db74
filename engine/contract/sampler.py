"""Seeded, resumable, data-parallel sample order.

Global order: global position ``k`` (every sample consumed since the start of training, all ranks together) maps
to dataset index ``perm_e[k mod N]`` with epoch ``e = k // N`` and ``perm_e = numpy.random.default_rng([seed, e])
.permutation(N)`` (identity when ``shuffle`` is off); the same definition as ``engine.train.data``.

Rank split (Megatron's ``MegatronPretrainingSampler``): each micro-step consumes ``micro_batch_size × dp_size``
consecutive global positions; rank ``r`` takes the ``micro_batch_size`` positions starting at ``r × micro_batch_size``
of that window. So the data state is one integer, ``consumed_samples``: a sampler built with
``consumed_samples=N`` continues with global position ``N`` (the ``N+1``-th sample), exactly where an uninterrupted
run would be, and what a global batch contains does not depend on the DP size.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class DistributedSampler:
    """Infinite iterator over this rank's micro-batches (lists of dataset indices); see the module docstring."""

    def __init__(
        self,
        num_samples: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 1234,
        consumed_samples: int = 0,
        shuffle: bool = True,
    ):
        if num_samples < 1:
            raise ValueError("num_samples: the dataset is empty")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank: {dp_rank} is outside 0..{dp_size - 1}")
        if consumed_samples % (micro_batch_size * dp_size):
            raise ValueError(f"consumed_samples: {consumed_samples} is not a multiple of micro_batch_size × dp_size")
        self.num_samples, self.micro_batch_size = num_samples, micro_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.consumed_samples = consumed_samples
        self._cached: tuple[int, np.ndarray] | None = None

    def _epoch(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            order = (
                np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                if self.shuffle
                else np.arange(self.num_samples)
            )
            self._cached = (epoch, order)
        return self._cached[1]

    def index_at(self, position: int) -> int:
        """Dataset index of global position ``position``."""
        return int(self._epoch(position // self.num_samples)[position % self.num_samples])

    def indices(self, start: int, stop: int) -> np.ndarray:
        """Dataset indices of global positions ``[start, stop)`` at once (the memory planner replays a run with it)."""
        out = np.empty(max(0, stop - start), dtype=np.int64)
        k = start
        while k < stop:
            epoch, offset = divmod(k, self.num_samples)
            take = min(stop - k, self.num_samples - offset)
            out[k - start : k - start + take] = self._epoch(epoch)[offset : offset + take]
            k += take
        return out

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            first = self.consumed_samples + self.dp_rank * self.micro_batch_size
            batch = [self.index_at(k) for k in range(first, first + self.micro_batch_size)]
            # Advance before yielding: a checkpoint taken after this batch records it as consumed.
            self.consumed_samples += self.micro_batch_size * self.dp_size
            yield batch
