"""Tail a run directory's files into the database in batches (and announce new rows on Redis pub/sub).

Reads only whole lines; an unfinished last line waits for the next poll, except on the final poll after the process
has exited. Offsets start at the files' sizes when the attempt starts, so a retry in the same run directory never
ingests the previous attempt's lines twice.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import func, insert, select, update

from core.db import session_scope
from core.models import Event, Job, LogLine, MetricPoint, utcnow
from core.pubsub import notify

MAX_BYTES_PER_POLL = 4 << 20  # bounds one transaction; the rest comes next poll
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
    return [{"job_id": job_id, "attempt": attempt, "time": _time(r.get("time")), "type": str(r.get("type", "message"))[:32],
             "level": LEVELS.get(str(r.get("type")), "info"), "message": str(r.get("message", "")),
             "data": r.get("data") if isinstance(r.get("data"), dict) else {}} for r in records]


def metric_rows(job_id: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in records:
        step, when = int(r.get("step", 0)), _time(r.get("time"))
        groups: list[tuple[int | None, Any]] = [(None, r.get("metrics") or {})]
        groups += [(int(rank), values) for rank, values in (r.get("rank_metrics") or {}).items()]
        for rank, values in groups:
            rows += [{"job_id": job_id, "step": step, "name": str(name)[:128], "value": _number(value), "rank": rank,
                      "time": when} for name, value in values.items()]
    return rows


@dataclass
class RunIngestor:
    """Copies one attempt's run files into the database."""

    database_url: str
    job_id: str
    run_dir: Path
    attempt: int
    redis_url: str | None = None
    last_error: dict[str, Any] | None = None
    _tails: dict[str, FileTail] = field(default_factory=dict)
    _log_seq: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("events.jsonl", "metrics.jsonl"):
            self._tails[name] = self._tail_from_end(self.run_dir / name)
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            self._tails[f"logs/{path.name}"] = self._tail_from_end(path)
        for path in sorted(self.run_dir.glob(TELEMETRY_GLOB)):
            self._tails[path.name] = self._tail_from_end(path)

    @staticmethod
    def _tail_from_end(path: Path) -> FileTail:
        return FileTail(path, path.stat().st_size if path.exists() else 0)

    def _discover_logs(self) -> None:
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            self._tails.setdefault(f"logs/{path.name}", FileTail(path))  # a file created during this attempt
        for path in sorted(self.run_dir.glob(TELEMETRY_GLOB)):
            self._tails.setdefault(path.name, FileTail(path))  # the worker's device samples (worker.telemetry)

    def _next_seq(self, session: Any, stream: str) -> int:
        if stream not in self._log_seq:
            last = session.scalar(select(func.max(LogLine.seq)).where(LogLine.job_id == self.job_id, LogLine.stream == stream))
            self._log_seq[stream] = -1 if last is None else last
        self._log_seq[stream] += 1
        return self._log_seq[stream]

    def poll(self, final: bool = False) -> dict[str, int]:
        """One batch: every new line of every file, in one transaction. ``final`` reads to the end of each file."""
        counts = {"events": 0, "metrics": 0, "logs": 0}
        while True:
            batch = self._poll_once(final)
            for key, n in batch.items():
                counts[key] += n
            if not final or not any(batch.values()):
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
        try:
            with session_scope(self.database_url) as session:
                logs = [{"job_id": self.job_id, "stream": key[5:-4][:32], "seq": self._next_seq(session, key[5:-4]),
                         "text": line[:MAX_LINE_CHARS], "time": utcnow()}
                        for key, (lines, _) in reads.items() if key.startswith("logs/") for line in lines]
                for model, rows in ((Event, event_rows(self.job_id, self.attempt, events)), (MetricPoint, metrics),
                                    (LogLine, logs)):
                    if rows:
                        session.execute(insert(model), rows)
                if events or metrics or logs:
                    session.execute(update(Job).where(Job.id == self.job_id).values(heartbeat_at=utcnow()))
        except Exception:
            self._log_seq.clear()  # re-read from the database next time; the offsets did not move
            raise
        for key, (_, offset) in reads.items():
            self._tails[key].offset = offset
        errors = [e for e in events if e.get("type") == "error"]
        if errors:
            self.last_error = errors[-1]
        return {"events": len(events), "metrics": len(metrics), "logs": len(logs)}
