"""Training data: indexed datasets from ``data_path``, a seeded global sample order, and each rank's micro-batches.

Order: global sample ``k`` (counting every sample of every iteration from the start of training) is sample
``perm_e[k mod N]`` of epoch ``e = k // N``, where ``perm_e`` is a permutation seeded by (seed, e). Iteration ``i``
(1-based) uses global samples ``[(i-1)·G, i·G)`` with ``G = global_batch_size``; as in Megatron's
``MegatronPretrainingSampler``, micro-batch ``m`` of DP rank ``r`` takes the ``micro_batch_size`` samples starting
at ``m·mbs·DP + r·mbs`` inside that window. So the data position is just ``consumed_samples`` (checkpointed), a
resumed run sees exactly the samples it would have seen, and the global batch of an iteration does not depend on
the DP size (DP=2 trains on the same samples as one process).

Datasets (``engine.contract.indexed``): MindSpeed instruction data ``<prefix>_packed_{input_ids,labels,...}_document``
(pre-packed rows are split back into their samples by their boundaries, so the trainer packs them its own way), or
pretraining text ``<prefix>`` / ``<prefix>_text_document`` where a sample is one document (or a ``seq_length``
window of a longer one) and every token is a label.
``split`` "train,valid,test" cuts the samples (in dataset order, as Megatron cuts documents) into a leading train
share, then a validation share (``split_counts``); each part has its own seeded order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from engine.contract.indexed import PAIRWISE_FIELDS, IndexedDataset, InstructionDataset, instruction_prefix
from engine.contract.lengths import dataset_exists, split_counts, text_prefix, text_windows, window_step
from engine.contract.runfiles import BadInput
from engine.contract.sampler import DistributedSampler
from engine.train.batches import Sample


class Source:
    """One dataset: ``samples(i)`` -> the samples of row ``i`` (several for a pre-packed row).

    Pretraining text: a document longer than ``seq_length`` tokens is several rows, windows of ``seq_length``
    tokens that overlap by one, so each next-token target is trained on exactly once (truncating would drop the
    rest of the document). Megatron concatenates documents into windows instead; here a window never spans two
    documents, and the padding-free packer fills micro-batches with them. With every document short enough, rows
    are documents, as before."""

    def __init__(self, prefix: str, seq_length: int, pairwise: bool = False):
        self.window_start: np.ndarray | None = None
        self.pairs: dict[str, IndexedDataset] | None = None
        self.ref_logps: np.ndarray | None = None  # (pairs, 2) float32: precomputed (engine.train.reference_logps)
        self.prefix = prefix
        self.instruction: InstructionDataset | None = None
        self.text: IndexedDataset | None = None
        try:  # a file that is not a Megatron index is the user's input, not a crash to retry
            if pairwise:
                self.pairs = {f: IndexedDataset(instruction_prefix(prefix, f)) for f in PAIRWISE_FIELDS}
                return
            if dataset_exists(instruction_prefix(prefix, "chosen_input_ids")):
                raise ValueError(f"{prefix} holds preference pairs: train on them with stage dpo")
            if dataset_exists(instruction_prefix(prefix, "input_ids")):
                self.instruction = InstructionDataset(prefix)
                return
            self.text = IndexedDataset(text_prefix(prefix))
        except (ValueError, FileNotFoundError) as err:
            raise BadInput(f"data_path: {err}", "data_path") from err
        self.step = window_step(seq_length)
        self.seq_length = seq_length
        self.window_start = text_windows(self.text.sequence_lengths, seq_length)

    def __len__(self) -> int:
        if self.pairs is not None:
            return len(self.pairs["chosen_input_ids"])
        if self.instruction is not None:
            return len(self.instruction)
        return len(self.text) if self.window_start is None else int(self.window_start[-1])  # type: ignore[arg-type]

    def samples(self, i: int) -> list[Sample]:
        if self.pairs is not None:  # a pair is one row: [chosen, rejected] (``batches.collate_pairs``)
            p, ref = self.pairs, self.ref_logps
            chosen, rejected = (None, None) if ref is None else (float(ref[i, 0]), float(ref[i, 1]))
            return [
                Sample(p["chosen_input_ids"][i], p["chosen_labels"][i], chosen),
                Sample(p["rejected_input_ids"][i], p["rejected_labels"][i], rejected),
            ]
        if self.text is not None:
            if self.window_start is None:
                ids = self.text[i]
            else:
                doc = int(np.searchsorted(self.window_start, i, side="right")) - 1
                first = (i - int(self.window_start[doc])) * self.step
                ids = self.text[doc][first : first + self.seq_length]
            return [Sample(ids, ids)]
        row = self.instruction[i]  # type: ignore[index]
        starts = np.concatenate(([0], row.boundaries[:-1]))
        return [Sample(row.input_ids[s:e], row.labels[s:e]) for s, e in zip(starts, row.boundaries, strict=True)]


def check_data_paths(paths: Sequence[str]) -> None:
    """BadInput naming the first prefix with no dataset files (before any work starts)."""
    for prefix in paths:
        try:
            float(prefix)
        except ValueError:
            pass
        else:
            raise BadInput(
                f"data_path: blending weights ({prefix!r}) are not supported; give prefixes only", "data_path"
            )
        candidates = [
            instruction_prefix(prefix, "chosen_input_ids"),
            instruction_prefix(prefix, "input_ids"),
            prefix,
            prefix + "_text_document",
        ]
        if not any(dataset_exists(c) for c in candidates):
            looked = ", ".join(c + ".bin/.idx" for c in candidates)
            raise BadInput(f"data_path: no indexed dataset for prefix {prefix!r} (looked for {looked})", "data_path")


@dataclasses.dataclass
class TrainData:
    """Samples ``[start, start + num_samples)`` of all ``data_path`` datasets (one index space), in a seeded order."""

    sources: list[Source]
    num_samples: int
    seed: int
    start: int = 0
    order: DistributedSampler = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        # The global order is engine.contract.sampler's (one definition for the reader's users and the trainer).
        self.order = DistributedSampler(self.num_samples, micro_batch_size=1, seed=self.seed)

    @classmethod
    def open(cls, paths: Sequence[str], split: str, seed: int, seq_length: int, pairwise: bool = False) -> TrainData:
        """The training share (samples of at most ``seq_length`` tokens; see ``Source``); ``pairwise``: preference
        pairs, one pair per row."""
        check_data_paths(paths)
        sources = [Source(p, seq_length, pairwise) for p in paths]
        total = sum(len(s) for s in sources)
        n = split_counts(total, split)[0]
        if n < 1:
            raise BadInput(f"data_path: {total} samples and split {split!r} leave no training sample", "data_path")
        return cls(sources, n, seed)

    def validation(self, split: str) -> TrainData | None:
        """The validation share that follows the training one (same datasets); None when the split leaves none."""
        total = sum(len(s) for s in self.sources)
        train, valid = split_counts(total, split)
        return TrainData(self.sources, valid, self.seed, start=train) if valid > 0 else None

    def _row(self, index: int) -> list[Sample]:
        for src in self.sources:
            if index < len(src):
                return src.samples(index)
            index -= len(src)
        raise IndexError(index)

    def sample_at(self, k: int) -> list[Sample]:
        """The row (one or more samples) at global sample position ``k``."""
        return self._row(self.start + self.order.index_at(k))


def rank_positions(iteration: int, global_batch: int, micro_batch: int, dp: int, dp_rank: int) -> list[range]:
    """Global sample positions of each of this rank's micro-batches in 1-based ``iteration``."""
    start = (iteration - 1) * global_batch
    per_step = micro_batch * dp
    firsts = (start + m * per_step + dp_rank * micro_batch for m in range(global_batch // per_step))
    return [range(first, first + micro_batch) for first in firsts]


def rank_micro_batches(
    data: TrainData, iteration: int, global_batch: int, micro_batch: int, dp: int, dp_rank: int
) -> list[list[Sample]]:
    """The samples of each of this rank's micro-batches for 1-based ``iteration`` (only this rank's rows are read)."""
    return [
        [s for k in positions for s in data.sample_at(k)]
        for positions in rank_positions(iteration, global_batch, micro_batch, dp, dp_rank)
    ]
