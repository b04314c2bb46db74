"""Stage dpo with ``precompute_ref_log_probs``: the reference's log-probs of every pair, computed once before training
and stored beside the dataset, so training runs without the reference in memory and later runs reuse them.

The table of a dataset prefix is ``(pairs, 2)`` float32 (chosen, rejected summed log-probs, as ``dpo.Reference.logps``
gives them), saved as ``<prefix>_ref_logps/<key>.npy`` (NumPy, read with ``allow_pickle=False``) with a JSON note of
what the key covers; where the dataset's folder is not writable for this job, under the run directory instead (used
by this run only). The key hashes everything the numbers depend on: the four pairwise files (each ``.idx`` whole, the
``.bin`` size and mtime), the reference checkpoint's files (names, sizes, mtimes) or the seed it is drawn from, the
model shape, the compute dtype, the device type, TP, CP (size and algorithm, when above 1), the micro-batch size,
``seq_length``, padding and the loss chunk.

The pass cuts pairs into micro-batches of ``micro_batch_size`` consecutive pairs, padded as training pads them, so
with one pair per micro-batch a precomputed log-prob is the one an online reference computes, bit for bit. Chunk
``c`` goes to DP rank ``c % dp``; every rank runs the same number of forwards (a rank out of chunks recomputes its
first one and drops it) because the reference is sharded over DP and each forward gathers; the shares are summed over
DP. Global rank 0 decides whether a stored table is used and broadcasts it, so ranks never disagree about the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from engine.contract.guard import check_output, check_path
from engine.contract.indexed import PAIRWISE_FIELDS, instruction_prefix
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput, RunDir
from engine.contract.spec import TrainSpec
from engine.parallel.data_parallel import reshard_all
from engine.parallel.precision import compute_dtype
from engine.train.batches import MicroBatch, collate_pairs
from engine.train.data import Source, TrainData
from engine.train.dpo import Reference, over_context, rows_from_hidden
from engine.train.step_runner import PipelineRunner

VERSION = 1  # bump when what a stored table means changes


def _file_facts(path: Path) -> list[Any]:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def _dataset_facts(prefix: str) -> list[Any]:
    facts: list[Any] = []
    for field in PAIRWISE_FIELDS:
        base = Path(instruction_prefix(prefix, field))
        idx = base.with_name(base.name + ".idx")
        with open(idx, "rb") as f:  # streamed: an index of millions of documents is hundreds of MB
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        facts += [digest, _file_facts(base.with_name(base.name + ".bin"))]
    return facts


def _checkpoint_facts(path: str | None, seed: int) -> list[Any]:
    if path is None:
        return ["seeded", seed]
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    return [str(root.resolve()), *[[str(p.relative_to(root)), *_file_facts(p)[1:]] for p in files if p != root]]


def table_key(
    spec: TrainSpec, cfg: ModelConfig, prefix: str, seq_length: int, tp: int, device_type: str
) -> tuple[str, dict[str, Any]]:
    """The cache key of ``prefix``'s table and the facts it hashes (written beside the table)."""
    facts = {
        "version": VERSION,
        "dataset": _dataset_facts(prefix),
        # LoRA: the base with its adapters off; else the frozen copy's checkpoint (ref_model or load)
        "reference": _checkpoint_facts(spec.load if spec.is_lora else spec.ref_model or spec.load, spec.seed),
        "model": dataclasses.asdict(cfg),
        "dtype": str(compute_dtype(spec)),
        "device_type": device_type,
        "tp": tp,
        **({"cp": [spec.context_parallel_size, spec.context_parallel_algo]} if spec.context_parallel_size > 1 else {}),
        "micro_batch_size": spec.micro_batch_size,
        "seq_length": seq_length,
        "variable_seq_lengths": spec.variable_seq_lengths,
        "cross_entropy_chunk_size": spec.cross_entropy_chunk_size,
    }
    blob = json.dumps(facts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32], facts


def _places(prefix: str, key: str, run: RunDir) -> list[Path]:
    """Where the table may live: beside the dataset when this job may write there, then the run directory."""
    beside = Path(prefix + "_ref_logps") / f"{key}.npy"
    places = [run.path / "ref_logps" / f"{Path(prefix).name}-{key}.npy"]
    try:
        check_output("data_path", beside)
    except BadInput:
        return places
    return [beside, *places]


def _load(places: Sequence[Path], pairs: int) -> np.ndarray | None:
    for path in places:
        try:
            check_path("data_path", path, output=False)
            table = np.load(path, allow_pickle=False)
        except (OSError, ValueError, BadInput):
            continue
        if table.shape == (pairs, 2) and table.dtype == np.float32:
            return table
    return None


def _save(places: Sequence[Path], table: np.ndarray, facts: dict[str, Any]) -> Path | None:
    for path in places:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            check_output("data_path", path)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                np.save(f, table, allow_pickle=False)
            os.replace(tmp, path)
            path.with_suffix(".json").write_text(json.dumps(facts, indent=1, default=str) + "\n")
            return path
        except (OSError, BadInput):
            continue
    return None


class Forward(Protocol):
    """Row log-probs of micro-batches: a list (one (rows,) tensor each) where this rank computes them, else None
    (a pipeline's stages before the last)."""

    group: int  # micro-batches per call (a pipeline step's count)

    def __call__(self, batches: list[MicroBatch]) -> list[torch.Tensor] | None: ...


Shard = Callable[[list[MicroBatch]], list[MicroBatch]]  # the job's cut of whole micro-batches for this rank


class ModelForward:
    """The frozen reference (or a LoRA policy with its adapters off), one micro-batch a call."""

    group = 1

    def __init__(self, reference: Reference, chunk_size: int) -> None:
        self.reference, self.chunk_size = reference, chunk_size

    def __call__(self, batches: list[MicroBatch]) -> list[torch.Tensor] | None:
        return [self.reference.logps(batches[0], self.chunk_size)]


class _RowCapture:
    """A pipeline's last-stage loss that records each micro-batch's row log-probs instead of a loss."""

    def __init__(self, chunk_size: int, context_group: dist.ProcessGroup | None) -> None:
        self.chunk_size, self.context_group = chunk_size, context_group
        self.rows: dict[int, torch.Tensor] = {}

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        return {}

    def begin(self, batches: Sequence[MicroBatch], device: torch.device) -> None:
        self.rows = {}

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, head: torch.Tensor, index: int) -> torch.Tensor:
        rows = rows_from_hidden(hidden, head, labels, self.chunk_size, isinstance(head, DTensor), logits=False)
        rows = over_context(rows, self.context_group)
        self.rows[index] = rows.logps.detach().float()
        return rows.logps.sum() * 0.0


class PipelineForward:
    """Under PP: the policy's own pipeline, forward only, before its first step, when it still is the reference
    (its starting weights; a LoRA policy's adapters are still zero), a pipeline step of micro-batches a call."""

    def __init__(
        self, runner: PipelineRunner, micro_batches: int, chunk_size: int, context_group: dist.ProcessGroup | None
    ) -> None:
        self.runner, self.group, self.capture = runner, micro_batches, _RowCapture(chunk_size, context_group)

    def __call__(self, batches: list[MicroBatch]) -> list[torch.Tensor] | None:
        with torch.no_grad(), self.runner.using(self.capture):
            self.runner.forward_only(batches)
        reshard_all(self.runner.pipeline.parts)  # before training's first step (``data_parallel.reshard_all``)
        return [self.capture.rows[i] for i in range(len(batches))] if self.runner.pipeline.is_last else None


def _compute(
    forward: Forward,
    source: Source,
    spec: TrainSpec,
    seq_length: int,
    mesh: DeviceMesh,
    device: torch.device,
    shard: Shard,
) -> torch.Tensor:
    """This rank's share of the table (zeros elsewhere), summed over PP and DP: every rank gets the whole table.
    CP ranks of one DP rank compute the same pairs, each on its slice of the rows (``shard``), and the reference
    completes each row's sum over CP as in training."""
    pairs, mbs = len(source), spec.micro_batch_size
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    chunks = [range(c, min(pairs, c + mbs)) for c in range(0, pairs, mbs)]
    mine = chunks[dp_rank::dp]
    per_rank = -(-len(chunks) // dp)
    calls = -(-per_rank // forward.group)  # equal on every rank: the reference's shards gather in each
    table = torch.zeros(pairs, 2, dtype=torch.float32, device=device)
    for n in range(calls):
        rows = [mine[i] if i < len(mine) else chunks[0] for i in range(n * forward.group, (n + 1) * forward.group)]
        batches = []
        for r in rows:  # a short last chunk is filled with pair 0 (a pipeline step's micro-batches are one size)
            picks = [*r, *([0] * (mbs - len(r)))] if forward.group > 1 else list(r)
            samples = [s for i in picks for s in source.samples(i)]
            batches.append(collate_pairs(samples, seq_length, spec.variable_seq_lengths).to(device))
        logps = forward(shard(batches))
        for i, (r, mb_logps) in enumerate(zip(rows, logps or [], strict=False)):
            if n * forward.group + i >= len(mine):
                continue
            k, width = len(r), len(mb_logps) // 2
            table[r.start : r.stop, 0] = mb_logps[:k]
            table[r.start : r.stop, 1] = mb_logps[width : width + k]
    if mesh["pp"].size() > 1:
        dist.all_reduce(table, group=mesh["pp"].get_group())  # only the last stage's are non-zero
    if dp > 1:
        dist.all_reduce(table, group=mesh["dp"].get_group())
    return table


def _broadcast_cached(table: np.ndarray | None, pairs: int, device: torch.device) -> torch.Tensor | None:
    """Rank 0's stored table on every rank, or None on every rank when rank 0 has none."""
    found = torch.tensor([table is not None], dtype=torch.int32, device=device)
    if dist.is_initialized():
        dist.broadcast(found, src=0)
    if not int(found.item()):
        return None
    out = torch.from_numpy(table).to(device) if table is not None else torch.empty(pairs, 2, device=device)
    if dist.is_initialized():
        dist.broadcast(out, src=0)
    return out


def precompute(
    forward: Forward | None,
    data: TrainData,
    spec: TrainSpec,
    cfg: ModelConfig,
    seq_length: int,
    mesh: DeviceMesh,
    run: RunDir,
    device: torch.device,
    shard: Shard,
) -> dict[str, Any]:
    """Attach every pairwise source's reference log-probs to ``data`` (its validation share reads the same
    sources), computing with ``forward`` what is not stored (``forward`` None: refuse to, naming why); returns what
    was done per prefix (``stored``/``reused`` and where) for the run's summary."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    done: dict[str, Any] = {}
    for source in data.sources:
        key, facts = table_key(spec, cfg, source.prefix, seq_length, mesh["tp"].size(), device.type)
        places = _places(source.prefix, key, run)
        cached = _broadcast_cached(_load(places, len(source)) if rank0 else None, len(source), device)
        if cached is not None:
            source.ref_logps = cached.cpu().numpy()
            done[source.prefix] = {"reused": str(places[0]), "key": key}
            continue
        if forward is None:
            raise BadInput(
                f"precompute_ref_log_probs: no stored reference log-probs of {source.prefix} for this run's key, and "
                "under pipeline parallelism they are computed from the starting weights only (this run resumed); "
                "run it again from the start, or without pipeline parallelism",
                "precompute_ref_log_probs",
            )
        with torch.no_grad():
            table = _compute(forward, source, spec, seq_length, mesh, device, shard).cpu().numpy()
        source.ref_logps = table
        saved = _save(places, table, facts) if rank0 else None
        done[source.prefix] = {"stored": str(saved) if saved else None, "key": key}
    return done
