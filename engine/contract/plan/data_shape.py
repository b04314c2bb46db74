"""The largest micro-batch a training job's data will form, found without torch and without reading a token.

The planner's ``this_data`` figure rests on it. The sample lengths come from the ``.idx`` files
(``engine.contract.lengths``, the trainer's own rules); the order is the trainer's (``engine.contract.sampler``: global
position ``k`` of the run is a seeded permutation's entry, micro-batches are consecutive runs of ``micro_batch_size``
positions), replayed over every position the run will consume (``train_iters × global_batch_size``), so the shape
found is the one the engine will meet, not a guess. Runs longer than ``REPLAY_LIMIT`` positions are bounded instead by
the worst micro-batch any order could form (the ``micro_batch_size`` heaviest rows together), which over that many
micro-batches is what a run meets anyway.

Micro-batch shape, as ``engine.train.batches`` forms it: packed (``padding_free``, the default) one row of the
samples' fed tokens summed; padded one row per sample, as wide as the longest (``variable_seq_lengths``) or
``seq_length - 1``; preference pairs are padded rows, chosen and rejected of every pair.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.contract.lengths import RowLengths, dataset_rows, padded_width, split_counts
from engine.contract.runfiles import BadInput
from engine.contract.sampler import DistributedSampler
from engine.contract.spec import TrainSpec

REPLAY_LIMIT = 1 << 23  # positions: under a second of numpy at submission (0.42 s per 2^22 measured)
_CHUNK = 1 << 22


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """One micro-batch as the engine pads it: ``rows`` × ``width`` token positions."""

    rows: int
    width: int
    position: int | None  # global sample position of its first row (None: bounded over any order, not replayed)

    @property
    def tokens(self) -> int:
        return self.rows * self.width

    def describe(self) -> str:
        where = f"at sample position {self.position}" if self.position is not None else "in any order of the data"
        return f"{self.rows} × {self.width} tokens {where}"


def _train_rows(spec: TrainSpec, seq_length: int) -> RowLengths:
    rows = RowLengths.concat([dataset_rows(p, seq_length, spec.is_pairwise_dataset) for p in spec.data_path])
    return rows.head(split_counts(len(rows.count), spec.split)[0])


def _shapes(rows: RowLengths, idx: np.ndarray, mbs: int, seq_length: int, spec: TrainSpec) -> tuple[np.ndarray, ...]:
    """(rows, width) of each micro-batch whose rows are ``idx`` (consecutive groups of ``mbs``)."""
    count, total, longest = (a[idx].reshape(-1, mbs) for a in (rows.count, rows.total, rows.longest))
    if spec.padding_free and spec.stage != "dpo":
        return np.ones(len(total), np.int64), total.sum(1)
    width = longest.max(1) if spec.variable_seq_lengths else np.full(len(count), seq_length - 1)
    return count.sum(1), width


def _replay(rows: RowLengths, spec: TrainSpec, gbs: int, seq_length: int) -> BatchShape:
    mbs, positions = spec.micro_batch_size, spec.train_iters * gbs
    order = DistributedSampler(len(rows.count), micro_batch_size=1, seed=spec.seed)
    best = BatchShape(0, 0, 0)
    step = _CHUNK - _CHUNK % mbs
    for start in range(0, positions, step):
        stop = min(positions, start + step)
        n_rows, width = _shapes(rows, order.indices(start, stop), mbs, seq_length, spec)
        tokens = n_rows * width
        i = int(tokens.argmax())
        if int(tokens[i]) > best.tokens:
            best = BatchShape(int(n_rows[i]), int(width[i]), start + i * mbs)
    return best


def _any_order(rows: RowLengths, spec: TrainSpec, seq_length: int) -> BatchShape:
    mbs = spec.micro_batch_size
    if spec.padding_free and spec.stage != "dpo":
        return BatchShape(1, int(np.sort(rows.total)[-mbs:].sum()), None)
    longest = int(rows.longest.max(initial=0))
    width = padded_width([longest], seq_length, spec.variable_seq_lengths)
    return BatchShape(int(np.sort(rows.count)[-mbs:].sum()), width, None)


def largest_micro_batch(spec: TrainSpec, global_batch_size: int, seq_length: int) -> BatchShape | None:
    """The largest micro-batch (in padded token positions) the train ``spec``'s data forms over its run; None when
    the data cannot be read (missing, still to be written by a pipeline step, not a Megatron dataset): the planner
    then has only its worst case."""
    if spec.kind != "train" or not spec.data_path:
        return None
    try:
        rows = _train_rows(spec, seq_length)
    except (OSError, ValueError, BadInput):
        return None
    if not len(rows.count):
        return None
    if spec.train_iters * global_batch_size > REPLAY_LIMIT:
        return _any_order(rows, spec, seq_length)
    return _replay(rows, spec, global_batch_size, seq_length)
