"""The trainer's own checkpoints: torch.distributed.checkpoint (DCP), sharded as trained, resumable at any DP size.

Layout under a ``save`` directory::

    <save>/train_state/latest_checkpointed_iteration.txt     the iteration of the newest complete checkpoint
    <save>/train_state/iter_0000100/.metadata, *.distcp      model (+ optimizer) shards, written by every rank
    <save>/train_state/iter_0000100/meta.json                iteration, consumed samples, scheduler, loss scaler,
                                                             counters, model config, LoRA settings (rank 0)
    <save>/train_state/iter_0000100/rng_rank{R}.pt           each rank's Python/NumPy/torch RNG states

Atomic: every rank writes into ``iter_XXXXXXX.tmp`` (files fsynced); once every rank says its writes succeeded, rank
0 fsyncs the directory, renames it and only then rewrites the tracker (temp file, fsync, rename). A save is refused
before it starts when the filesystem lacks room for one the size of the latest (``no_room``), and a write failing on
any rank (a disk filling up) fails the save on every rank and removes its ``.tmp``: never a half checkpoint. A crash mid-save leaves a ``.tmp`` directory that is ignored and removed on the next
save, and the tracker still names the previous complete checkpoint. Retention (``prune``, after a save is complete
and the tracker names it) renames a doomed ``iter_*`` to ``.trash`` before removing it, so a crash mid-delete leaves
no half checkpoint that looks complete; the next save removes the leftover. DCP reshards on load (FSDP2 dp2 -> one process
and back, docs/torch-distributed-on-gloo.md §e), so a re-queued job may come back on a different number of ranks.

LoRA runs save only trainable (adapter) parameters; the frozen base is re-read from ``load`` on resume.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from engine.checkpoint.durable import fsync_dir, write_synced
from engine.checkpoint.safe_pickle import SafeFileSystemReader, SafeLoadPlanner, load_torch_file
from engine.contract.owner import META, STATE_DIR, TRACKER, latest_state
from engine.contract.runfiles import DiskFull, is_disk_full
from engine.parallel.pipeline_parallel import dcp_state_view

TRASH = ".trash"


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def state_root(save: str | os.PathLike[str]) -> Path:
    return Path(save) / STATE_DIR


def latest(save: str | os.PathLike[str]) -> Path | None:
    """The newest complete training checkpoint under ``save`` (or ``save`` itself being ``train_state``), or None."""
    return latest_state(save)


def is_training_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True for a ``save`` directory holding our checkpoints, a ``train_state`` directory or one ``iter_*`` of it."""
    p = Path(path)
    return (p / META).is_file() and (p / ".metadata").is_file() or latest(p) is not None


def resolve(path: str | os.PathLike[str]) -> Path:
    """The ``iter_*`` directory a training-checkpoint path means."""
    p = Path(path)
    if (p / META).is_file():
        return p
    found = latest(p)
    if found is None:
        raise FileNotFoundError(f"{p}: no complete training checkpoint (no {STATE_DIR}/{TRACKER})")
    return found


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads((resolve(path) / META).read_text())


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _options(trainable_only: bool, strict: bool = True) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=strict)


def save(
    save_dir: str | os.PathLike[str],
    iteration: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: dict[str, Any],
    trainable_only: bool = False,
    save_rng: bool = True,
) -> Path:
    """Write one checkpoint collectively (every rank calls this); returns the final ``iter_*`` directory.

    Refused before it starts (``DiskFull``, on every rank) when the filesystem has no room for a checkpoint the size
    of the latest one. A write that fails on any rank (a disk filling up mid-save) fails on every rank: the partial
    ``.tmp`` is removed and the tracker still names the previous checkpoint. Every file is on disk (fsync) before the
    directory is renamed, and the tracker is replaced last."""
    root = state_root(save_dir)
    final = root / iter_name(iteration)
    tmp = root / (iter_name(iteration) + ".tmp")
    rank = dist.get_rank()
    refused = ""
    if rank == 0:
        for stale in (*root.glob("iter_*.tmp"), *root.glob("iter_*" + TRASH)):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
        refused = no_room(root)
    if _any_rank(bool(refused)):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise DiskFull(refused or "checkpoint refused before it started: no room on rank 0's filesystem")
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model, options=_options(trainable_only))}
    state, _ = dcp_state_view(state, model, "save")  # TP/PP layout -> the native global tensors
    failure: BaseException | None = None
    try:
        dcp.save(state, checkpoint_id=str(tmp))  # DCP's file writer fsyncs its files
        if save_rng:
            write_synced(tmp / f"rng_rank{rank}.pt", lambda f: torch.save(_rng_state(), f))
    except BaseException as err:  # DCP's CheckpointException is a BaseException; every rank must learn of it first
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        failure = err
    if _any_rank(failure is not None):  # instead of a barrier: a rank that failed alone would hang the others
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the tracker names the previous checkpoint
        _raise(failure, f"checkpoint at iteration {iteration}: another rank's write failed", root)
    if rank == 0:
        try:
            meta_text = json.dumps({**meta, "iteration": iteration, "has_optimizer": optimizer is not None})
            write_synced(tmp / META, lambda f: f.write(meta_text.encode()))
            fsync_dir(tmp)
            if final.exists():  # the same iteration saved again (a resumed run): replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            tracker_tmp = root / (TRACKER + ".tmp")
            write_synced(tracker_tmp, lambda f: f.write(str(iteration).encode()))
            os.replace(tracker_tmp, root / TRACKER)
            fsync_dir(root)
        except Exception as err:  # noqa: BLE001 - told to the other ranks below
            shutil.rmtree(tmp, ignore_errors=True)
            failure = err
    if _any_rank(failure is not None):
        _raise(failure, f"checkpoint at iteration {iteration}: rank 0 could not publish it", root)
    return final


def _raise(failure: BaseException | None, elsewhere: str, root: Path) -> NoReturn:
    """A failed save's error: ``DiskFull`` for a full disk (this rank's, or another rank's when this filesystem is
    nearly full too), else this rank's own error, else ``elsewhere`` (another rank failed)."""
    if failure is not None:
        if is_disk_full(failure):
            raise DiskFull(f"checkpoint write failed: {_first_line(failure)}") from failure
        raise failure
    if _disk_low(root):
        raise DiskFull(elsewhere)
    raise RuntimeError(elsewhere)


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if "No space" in line or "quota" in line]
    return lines[-1].strip() if lines else str(err).splitlines()[0] if str(err) else type(err).__name__


# A checkpoint starts only if the filesystem has room for one the size of the latest, with this margin.
ROOM_MARGIN = 1.1


def no_room(root: Path) -> str:
    """Why a new checkpoint under ``root`` would not fit (free space below the latest checkpoint's size times
    ``ROOM_MARGIN``), or "" (room, or no checkpoint yet to size it by)."""
    latest_dir = latest(root.parent)
    if latest_dir is None:
        return ""
    needed = int(sum(f.stat().st_size for f in latest_dir.rglob("*") if f.is_file()) * ROOM_MARGIN)
    free = shutil.disk_usage(root).free
    if free >= needed:
        return ""
    return (
        f"checkpoint refused before it started: {free / 2**20:.1f} MiB free under {root}, "
        f"a checkpoint needs about {needed / 2**20:.1f} MiB (the latest, {latest_dir.name}, stays the latest)"
    )


def _disk_low(root: Path) -> bool:
    try:
        return shutil.disk_usage(root).free < 2**20
    except OSError:
        return False


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank (a collective: every rank calls it)."""
    device = {"nccl": "cuda", "hccl": "npu"}.get(str(dist.get_backend()), "cpu")
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def complete_checkpoints(save_dir: str | os.PathLike[str]) -> dict[int, Path]:
    """iteration -> directory of every complete checkpoint under ``save_dir`` (unfinished and doomed ones left out)."""
    found = {}
    for path in state_root(save_dir).glob("iter_*"):
        digits = path.name.removeprefix("iter_")
        if digits.isdigit() and (path / META).is_file():
            found[int(digits)] = path
    return found


def prune(
    save_dir: str | os.PathLike[str], just_saved: int, keep_last_n: int | None, keep_best_by: str | None = None
) -> list[int]:
    """Delete the checkpoints retention does not keep (``engine.contract.retention``); returns their iterations.

    Rank 0 only, after ``save`` of ``just_saved`` returned (complete, tracker updated). ``keep_best_by`` is read from
    each checkpoint's meta.json ``metrics`` (written by the trainer at save time)."""
    from engine.contract.retention import to_delete

    found = complete_checkpoints(save_dir)
    values: dict[int, float | None] = {}
    for iteration, path in found.items():
        values[iteration] = None
        if keep_best_by:
            try:
                value = json.loads((path / META).read_text()).get("metrics", {}).get(keep_best_by)
            except (OSError, ValueError, AttributeError):
                value = None
            values[iteration] = float(value) if isinstance(value, (int, float)) else None
    doomed = to_delete(values, just_saved, keep_last_n, keep_best=bool(keep_best_by))
    for iteration in doomed:
        trash = found[iteration].with_name(found[iteration].name + TRASH)
        shutil.rmtree(trash, ignore_errors=True)  # a leftover of a crash mid-delete
        os.replace(found[iteration], trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainable_only: bool = False,
    load_rng: bool = True,
) -> dict[str, Any]:
    """Load model (and optimizer when given and saved) in place, collectively; returns meta.json."""
    ckpt = resolve(path)
    meta = json.loads((ckpt / META).read_text())
    _saved_keys(ckpt)  # read .metadata here first: a refused class is a BadInput, not wrapped by DCP's collectives
    # A LoRA checkpoint holds adapters only: the frozen base is neither expected nor required.
    opts = _options(trainable_only, strict=not trainable_only)
    if optimizer is not None and meta.get("has_optimizer"):
        model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
        view, finish = dcp_state_view({"model": model_sd, "optim": optim_sd}, model, "load")
        dcp.load(view, storage_reader=SafeFileSystemReader(str(ckpt)), planner=SafeLoadPlanner())
        state = finish()
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts)
    else:
        view, finish = dcp_state_view({"model": get_model_state_dict(model, options=opts)}, model, "load")
        dcp.load(view, storage_reader=SafeFileSystemReader(str(ckpt)), planner=SafeLoadPlanner())
        state = finish()
        set_model_state_dict(model, state["model"], options=opts)
    rng = ckpt / f"rng_rank{dist.get_rank()}.pt"
    if load_rng and rng.is_file():
        _set_rng_state(load_torch_file(rng))
    return meta


def _saved_keys(ckpt: Path) -> set[str]:
    return set(SafeFileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


def read_saved(ckpt: Path, keys: set[str]) -> dict[str, Any]:
    """The saved entries ``keys`` (DCP's flattened names, e.g. ``model.embedding.word_embeddings.weight``) read
    whole into this one process, keyed as asked.

    DCP's public ``load`` into CPU tensors sized from the checkpoint's ``.metadata``, with ``no_dist=True``: no
    collective runs even when a process group is up, so any rank may call it alone. ``.metadata`` and non-tensor
    items go through the allow-list (``SafeFileSystemReader`` / ``SafeLoadPlanner``).
    """
    reader = SafeFileSystemReader(str(ckpt))
    saved = reader.read_metadata().state_dict_metadata
    state: dict[str, Any] = {}
    for key in keys:
        item = saved[key]
        state[key] = (
            torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
        )  # a non-tensor item is replaced by its unpickled value
    with warnings.catch_warnings():  # the single-process load is asked for, not assumed as the warning says
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return state


def load_model_weights(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(meta.json, full native model state dict) read in this one process, for converters and evaluation.

    LoRA checkpoints return adapter tensors only; meta["lora"] tells how to merge them.
    """
    ckpt = resolve(path)
    meta = json.loads((ckpt / META).read_text())
    loaded = read_saved(ckpt, {k for k in _saved_keys(ckpt) if k.startswith("model.")})
    return meta, {k[len("model.") :]: v for k, v in loaded.items()}


class DcpWeights:
    """A training checkpoint as a ``WeightSource`` (``engine.checkpoint.sources``), read in this one process one
    tensor at a time: DCP's planner reads only the saved chunks of the asked key (for converters and evaluation;
    training restores through ``load``, sharded by the rank's own DTensors)."""

    def __init__(self, path: str | os.PathLike[str]):
        from engine.contract.model_config import ModelConfig

        self.path = resolve(path)
        self.meta = json.loads((self.path / META).read_text())
        if not self.meta.get("model_config"):
            raise ValueError(f"{self.path}: the training checkpoint's meta.json has no model_config")
        self.config = ModelConfig(**self.meta["model_config"])

    def get_native(self, key: str) -> torch.Tensor:
        if key == _COPY_KEY and self.config.tie_word_embeddings:
            key = _NATIVE_KEY
        tensor: torch.Tensor = read_saved(self.path, {f"model.{key}"})[f"model.{key}"]
        return tensor

    def get_native_shard(self, key: str, tp: int, rank: int) -> torch.Tensor:
        from engine.checkpoint.layout import shard, split_rule

        return shard(self.get_native(key), split_rule(key), tp, rank)

    def lora_modules(self) -> list[str]:
        keys = (k[len("model.") :] for k in _saved_keys(self.path) if k.startswith("model.") and ".lora_A." in k)
        return sorted({k.rsplit(".lora_A.", 1)[0] for k in keys})


_COPY_KEY, _NATIVE_KEY = "output_layer.weight", "embedding.word_embeddings.weight"
