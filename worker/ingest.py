"""Tail a run directory's files into the database in batches (and announce new rows on Redis pub/sub).

Reads only whole lines; an unfinished last line waits for the next poll, except on the final poll after the process
has exited. Offsets start at the files' sizes when the attempt starts, so a retry in the same run directory never
ingests the previous attempt's lines twice.

While the database is away the run files themselves are the buffer: a batch that could not be stored leaves every
offset where it was, so nothing is held in memory beyond one batch (``MAX_BYTES_PER_POLL`` per file) and nothing is
lost or stored twice; the engine goes on writing its files meanwhile. Once a batch is stored again, each poll drains
up to ``CATCH_UP_BATCHES`` full batches of the backlog, so the database catches up in a few polls.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import func, insert, select, update

from core.db import session_scope
from core.models import Event, Job, LogLine, MetricPoint, utcnow
from core.pubsub import notify

log = logging.getLogger(__name__)
MAX_BYTES_PER_POLL = 4 << 20  # bounds one transaction; the rest comes next poll
CATCH_UP_BATCHES = 16  # full batches one (non-final) poll stores after an outage, before the caller looks around
MAX_LINE_CHARS = 16_000
LEVELS = {"error": "error", "warning": "warn"}
TELEMETRY_GLOB = "telemetry-node*.jsonl"  # written by worker.telemetry, in metrics.jsonl's shape


class FileTail:
    """Complete lines appended to one file since ``offset``."""

    def __init__(self, path: Path, offset: int = 0):
        self.path, self.offset = path, offset

    def read_lines(self, final: bool = False) -> tuple[list[str], int]:
        """The new lines and the offset after them; the caller advances ``offset`` once they are stored."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read(MAX_BYTES_PER_POLL)
        except FileNotFoundError:
            return [], self.offset
        end = chunk.rfind(b"\n") + 1
        if final and len(chunk) < MAX_BYTES_PER_POLL:
            end = len(chunk)  # the writer is gone: an unterminated last line is still a line
        return chunk[:end].decode("utf-8", errors="replace").splitlines(), self.offset + end

    def behind(self) -> bool:
        """More than one batch is left to read (a backlog, e.g. after a database outage)."""
        try:
            return self.path.stat().st_size - self.offset >= MAX_BYTES_PER_POLL
        except FileNotFoundError:
            return False


def _time(value: Any) -> datetime:
    try:
        return datetime.fromtimestamp(float(value), tz=timezone.utc)
    except (TypeError, ValueError, OverflowError):
        return utcnow()


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _json_lines(lines: list[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line from a crashed writer: skip it, keep the rest
        if isinstance(record, dict):
            out.append(record)
    return out


def event_rows(job_id: str, attempt: int, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "job_id": job_id,
            "attempt": attempt,
            "time": _time(r.get("time")),
            "type": str(r.get("type", "message"))[:32],
            "level": LEVELS.get(str(r.get("type")), "info"),
            "message": str(r.get("message", "")),
            "data": r.get("data") if isinstance(r.get("data"), dict) else {},
        }
        for r in records
    ]


def metric_rows(job_id: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in records:
        step, when = int(r.get("step", 0)), _time(r.get("time"))
        groups: list[tuple[int | None, Any]] = [(None, r.get("metrics") or {})]
        groups += [(int(rank), values) for rank, values in (r.get("rank_metrics") or {}).items()]
        for rank, values in groups:
            rows += [
                {
                    "job_id": job_id,
                    "step": step,
                    "name": str(name)[:128],
                    "value": _number(value),
                    "rank": rank,
                    "time": when,
                }
                for name, value in values.items()
            ]
    return rows


@dataclass
class Batch:
    """One poll's new lines, parsed: event and metric rows, and log lines as (stream, text)."""

    events: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    logs: list[tuple[str, str]]

    def counts(self) -> dict[str, int]:
        return {"events": len(self.events), "metrics": len(self.metrics), "logs": len(self.logs)}


class DatabaseSink:
    """Stores a batch in one transaction (log lines numbered per stream after the newest stored one) and beats the
    job's heartbeat. Raises when the database is away; the caller keeps the batch's lines in the files for later."""

    def __init__(self, database_url: str, job_id: str):
        self.database_url, self.job_id = database_url, job_id
        self._log_seq: dict[str, int] = {}

    def _next_seq(self, session: Any, stream: str) -> int:
        if stream not in self._log_seq:
            last = session.scalar(
                select(func.max(LogLine.seq)).where(LogLine.job_id == self.job_id, LogLine.stream == stream)
            )
            self._log_seq[stream] = -1 if last is None else last
        self._log_seq[stream] += 1
        return self._log_seq[stream]

    def __call__(self, batch: Batch) -> None:
        try:
            with session_scope(self.database_url) as session:
                logs = [
                    {
                        "job_id": self.job_id,
                        "stream": stream,
                        "seq": self._next_seq(session, stream),
                        "text": text,
                        "time": utcnow(),
                    }
                    for stream, text in batch.logs
                ]
                for model, rows in ((Event, batch.events), (MetricPoint, batch.metrics), (LogLine, logs)):
                    if rows:
                        session.execute(insert(model), rows)
                if batch.events or batch.metrics or batch.logs:
                    session.execute(update(Job).where(Job.id == self.job_id).values(heartbeat_at=utcnow()))
        except Exception:
            self._log_seq.clear()  # re-read from the database next time
            raise


@dataclass
class RunIngestor:
    """Copies one attempt's run files into ``sink`` (the database unless given)."""

    database_url: str
    job_id: str
    run_dir: Path
    attempt: int
    redis_url: str | None = None
    sink: Callable[[Batch], None] | None = None
    last_error: dict[str, Any] | None = None
    away_since: float | None = None  # monotonic time of the first failed store of the current outage
    start_offsets: dict[str, int] | None = None  # resume where an earlier ingestor of this attempt stopped
    _tails: dict[str, FileTail] = field(default_factory=dict)
    _store: Callable[[Batch], None] = field(init=False)

    def __post_init__(self) -> None:
        self._store = self.sink or DatabaseSink(self.database_url, self.job_id)
        if self.start_offsets is not None:
            self._tails = {key: FileTail(self.run_dir / key, offset) for key, offset in self.start_offsets.items()}
            return
        for name in ("events.jsonl", "metrics.jsonl"):
            self._tails[name] = self._tail_from_end(self.run_dir / name)
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            self._tails[f"logs/{path.name}"] = self._tail_from_end(path)
        for path in sorted(self.run_dir.glob(TELEMETRY_GLOB)):
            self._tails[path.name] = self._tail_from_end(path)

    @staticmethod
    def _tail_from_end(path: Path) -> FileTail:
        return FileTail(path, path.stat().st_size if path.exists() else 0)

    def offsets(self) -> dict[str, int]:
        """Each file's offset up to which its lines are stored (``start_offsets`` of a later ingestor)."""
        return {key: tail.offset for key, tail in self._tails.items()}

    def _discover_logs(self) -> None:
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            self._tails.setdefault(f"logs/{path.name}", FileTail(path))  # a file created during this attempt
        for path in sorted(self.run_dir.glob(TELEMETRY_GLOB)):
            self._tails.setdefault(path.name, FileTail(path))  # the worker's device samples (worker.telemetry)

    def poll(self, final: bool = False) -> dict[str, int]:
        """Store new lines: one batch, or while there is a backlog up to ``CATCH_UP_BATCHES`` of them; ``final``
        reads to the end of each file. Raises if the sink fails (nothing moved: the next poll stores the same
        lines and the ones written since)."""
        counts = {"events": 0, "metrics": 0, "logs": 0}
        for batches in itertools.count(1):
            batch = self._poll_once(final)
            for key, n in batch.items():
                counts[key] += n
            if not any(batch.values()):
                break
            if not final and (batches >= CATCH_UP_BATCHES or not any(t.behind() for t in self._tails.values())):
                break
        if any(counts.values()):
            notify(self.redis_url, self.job_id, **counts)
        return counts

    def _poll_once(self, final: bool) -> dict[str, int]:
        self._discover_logs()
        reads = {key: tail.read_lines(final) for key, tail in self._tails.items()}
        events = _json_lines(reads["events.jsonl"][0])
        metrics = metric_rows(self.job_id, _json_lines(reads["metrics.jsonl"][0]))
        for key, (lines, _) in reads.items():
            if key.startswith("telemetry"):
                metrics += metric_rows(self.job_id, _json_lines(lines))
        logs = [
            (key[5:-4][:32], line[:MAX_LINE_CHARS])
            for key, (lines, _) in reads.items()
            if key.startswith("logs/")
            for line in lines
        ]
        batch = Batch(event_rows(self.job_id, self.attempt, events), metrics, logs)
        if batch.events or batch.metrics or batch.logs:
            try:
                self._store(batch)
            except Exception:
                if self.away_since is None:
                    self.away_since = time.monotonic()
                    log.warning(
                        "job %s: cannot store run files (the database is away?); they stay on disk until it answers",
                        self.job_id,
                    )
                raise
            if self.away_since is not None:
                log.warning(
                    "job %s: storing run files again after %.1f s; catching up",
                    self.job_id,
                    time.monotonic() - self.away_since,
                )
                self.away_since = None
        for key, (_, offset) in reads.items():
            self._tails[key].offset = offset
        errors = [e for e in events if e.get("type") == "error"]
        if errors:
            self.last_error = errors[-1]
        return batch.counts()
