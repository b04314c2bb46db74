"""The run directory: the only contract between the worker and the engine.

Layout of ``<run_dir>`` (the worker creates it and writes ``spec.json``; the engine writes the rest):

- ``spec.json``      the job spec (``engine.contract.spec``), input.
- ``events.jsonl``   one JSON object per line: ``{"time": unix_s, "type": str, "message": str, "data": {...}}``.
                     Types: ``started``, ``progress`` (data: ``done``, ``total``, ``unit``), ``checkpoint``
                     (data: ``iteration``, ``path``), ``warning``, ``error`` (data: ``code``), ``finished``.
- ``metrics.jsonl``  one JSON object per training iteration (or eval step), written by global rank 0 only:
                     ``{"time": unix_s, "step": int, "metrics": {name: number}, "rank_metrics": {"0": {name: number}}}``.
- ``logs/rank{R}.log`` each rank's log (``setup_logging``); ``logs/launcher.log`` the launcher's own output.
- ``result.json``    written once at success: ``{"kind": str, "outputs": {name: str}, "summary": {...}}``.
                     ``outputs`` are what pipelines reference as ``${steps.<name>.outputs.<key>}``.

Lines are appended whole and flushed at once, so a reader tailing the files never sees a torn line
other than the last one being written (readers keep an incomplete last line for the next read).
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Exit codes of ``python -m engine``: the worker decides retry/no-retry on them.
EXIT_OK = 0
EXIT_FAILED = 1  # an error in the engine; retryable up to max_restarts
EXIT_BAD_INPUT = 2  # the spec or the input data is wrong; never retried
EXIT_RETRYABLE = 75  # EX_TEMPFAIL: a transient fault (lost peer, timeout); retry from the last checkpoint


class DiskFull(Exception):
    """No room on a filesystem the job writes to (ENOSPC/EDQUOT, or a checkpoint refused before it starts):
    reported with code ``disk_full`` and exit code 75 (retryable once space returns). Nothing was left half-written:
    the previous checkpoint stays the latest."""


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps: its cause, context, or a DCP CheckpointException's per-rank failures) is a
    full disk or an exceeded quota."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, DiskFull) or (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo.extend(f for f in failures.values() if isinstance(f, BaseException))
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return False


class BadInput(Exception):
    """A user error (spec, data, checkpoint mismatch): reported with its message, exit code 2, never retried."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def _clean(value: object) -> object:
    """JSON has no NaN/Inf: write them as strings so a reader never fails on a bad loss."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class RunDir:
    """Writer for one run directory. Safe to share between threads; only rank 0 should write events/metrics."""

    def __init__(self, path: str | os.PathLike[str], rank: int = 0):
        self.path = Path(path)
        self.rank = rank
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "logs").mkdir(exist_ok=True)
        self._lock = threading.Lock()

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def _append(self, name: str, obj: dict[str, Any]) -> None:
        if not self.is_writer:
            return
        line = json.dumps(_clean(obj), ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock, open(self.path / name, "a", encoding="utf-8") as f:
            f.write(line)

    def event(self, type: str, message: str = "", **data: object) -> None:
        self._append("events.jsonl", {"time": time.time(), "type": type, "message": message, "data": data})

    def progress(self, done: int, total: int | None, unit: str, message: str = "") -> None:
        self.event(
            "progress",
            message or f"{done}/{total if total is not None else '?'} {unit}",
            done=done,
            total=total,
            unit=unit,
        )

    def metric(
        self, step: int, metrics: dict[str, float], rank_metrics: dict[int, dict[str, float]] | None = None
    ) -> None:
        record: dict[str, Any] = {"time": time.time(), "step": step, "metrics": metrics}
        if rank_metrics:
            record["rank_metrics"] = {str(r): m for r, m in rank_metrics.items()}
        self._append("metrics.jsonl", record)

    def write_json(self, name: str, obj: object) -> Path:
        """Write ``name`` atomically (temp file + rename) so a crash never leaves half a file."""
        target = self.path / name
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(_clean(obj), indent=2, ensure_ascii=False))
        os.replace(tmp, target)
        return target

    def write_result(self, kind: str, outputs: dict[str, str], summary: dict[str, Any] | None = None) -> None:
        if self.is_writer:
            self.write_json("result.json", {"kind": kind, "outputs": outputs, "summary": summary or {}})


def read_result(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    path = Path(run_dir) / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def setup_logging(run_dir: str | os.PathLike[str] | None, rank: int = 0, level: int = logging.INFO) -> None:
    """Log to stderr and, with a run dir, to ``logs/rank{R}.log`` (the worker tails these into the database)."""
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(level)
    for h in list(root.handlers):
        root.removeHandler(h)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(fmt)
    root.addHandler(stream)
    if run_dir is not None:
        log_dir = Path(run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(log_dir / f"rank{rank}.log", encoding="utf-8")
        fh.setFormatter(fmt)
        root.addHandler(fh)
