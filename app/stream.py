"""The SSE stream of one job: state changes, engine events, metric points and log lines, in database order.

Every message's id is the cursor "<event id>-<metric point id>-<log line id>" after it, so Last-Event-ID resumes
all three feeds exactly. The stream wakes on Redis pub/sub when configured (pushed), else re-checks every
``stream_poll_s``; the rows always come from the database. It ends with an ``end`` message once the job is terminal
and everything has been sent (the one message without an id).
"""

from __future__ import annotations

import asyncio
import heapq
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import anyio
from sqlalchemy.orm import Session
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send
from typing_extensions import Self

from core import records
from core.db import session_scope
from core.models import MetricPoint
from core.pubsub import channel
from core.settings import Settings
from core.states import JobState

BATCH = 500


@dataclass(frozen=True)
class Cursor:
    event: int = 0
    metric: int = 0
    log: int = 0

    @classmethod
    def parse(cls, text: str | None) -> Cursor:
        if not text:
            return cls()
        parts = text.split("-")
        if len(parts) != 3 or not all(p.isdigit() and len(p) <= 19 and int(p) < 2**63 for p in parts):
            raise ValueError(f"expected '<event>-<metric>-<log>' ids below 2**63, got {text[:80]!r}")
        return cls(*(int(p) for p in parts))

    def __str__(self) -> str:
        return f"{self.event}-{self.metric}-{self.log}"


def _iso(value: Any) -> str:
    return value.isoformat()


def fetch(settings: Settings, job_id: str, cursor: Cursor) -> tuple[list[dict[str, Any]], Cursor, bool]:
    """New rows after ``cursor`` as SSE messages, the advanced cursor, and whether the job was terminal before."""
    with session_scope(settings.database_url) as session:
        # Read the state first: if it is terminal now, every row the worker wrote is already committed.
        terminal = JobState(records.job_state(session, job_id)).is_terminal()
        feeds = [
            _events(session, job_id, cursor.event),
            _metrics(session, job_id, cursor.metric),
            _logs(session, job_id, cursor.log),
        ]
    messages = []
    # Interleave the three feeds by time; each keeps its id order, so every message's cursor stays exact.
    for _when, feed, row_id, name, payload in heapq.merge(*feeds, key=lambda item: item[0]):
        cursor = replace(cursor, **{feed: row_id})
        messages.append({"event": name, "id": str(cursor), "data": json.dumps(payload)})
    return messages, cursor, terminal


Item = tuple[datetime, str, int, str, dict[str, Any]]  # (time, cursor field, row id, SSE event name, payload)


def _events(session: Session, job_id: str, after: int) -> list[Item]:
    rows = records.events_after(session, job_id, after, BATCH)
    return [
        (
            e.time,
            "event",
            e.id,
            "state" if e.type == "state" else "event",
            {"id": e.id, "type": e.type, "level": e.level, "message": e.message, "data": e.data, "time": _iso(e.time)},
        )
        for e in rows
    ]


def _metrics(session: Session, job_id: str, after: int) -> list[Item]:
    points = records.metric_points_after(session, job_id, after, BATCH * 4)
    return [
        (
            g[0].time,
            "metric",
            g[-1].id,
            "metric",
            {"step": g[0].step, "rank": g[0].rank, "time": _iso(g[0].time), "metrics": {p.name: p.value for p in g}},
        )
        for g in _group_points(points)
    ]


def _logs(session: Session, job_id: str, after: int) -> list[Item]:
    rows = records.log_lines_after(session, job_id, after, BATCH * 4)
    return [
        (
            line.time,
            "log",
            line.id,
            "log",
            {"stream": line.stream, "seq": line.seq, "text": line.text, "time": _iso(line.time)},
        )
        for line in rows
    ]


def _group_points(points: list[MetricPoint]) -> list[list[MetricPoint]]:
    """One message per (step, rank): a training step's metrics arrive together."""
    groups: list[list[MetricPoint]] = []
    for point in points:
        if groups and (groups[-1][0].step, groups[-1][0].rank) == (point.step, point.rank):
            groups[-1].append(point)
        else:
            groups.append([point])
    return groups


class StreamResponse(EventSourceResponse):
    """The SSE answer; ``on_close`` runs however the sending ends (the job ended, the client went, the server stops)."""

    def __init__(self, content: AsyncIterator[dict[str, Any]], on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Waiter:
    """Waits until the job may have new rows: a pub/sub message (Redis), or the poll interval."""

    def __init__(self, settings: Settings, job_id: str):
        self.settings, self.job_id = settings, job_id
        self._client: Any = None
        self._pubsub: Any = None

    async def __aenter__(self) -> Self:
        if self.settings.redis_url:
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(self.settings.redis_url)
            self._pubsub = self._client.pubsub()
            await self._pubsub.subscribe(channel(self.job_id))  # before the first read, so no publish is missed
        return self

    async def wait(self) -> None:
        if self._pubsub is None:
            await asyncio.sleep(self.settings.stream_poll_s)
            return
        # The timeout is a safety net; a publish normally wakes us at once.
        timeout = max(self.settings.stream_poll_s, 5.0)
        if await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout):
            await asyncio.sleep(0.05)  # let a burst of notifications land in one read

    async def __aexit__(self, *exc: object) -> None:
        if self._pubsub is not None:
            await self._pubsub.aclose()
            await self._client.aclose()


async def job_stream(settings: Settings, job_id: str, cursor: Cursor) -> AsyncIterator[dict[str, Any]]:
    async with Waiter(settings, job_id) as waiter:
        while True:
            messages, cursor, terminal = await anyio.to_thread.run_sync(fetch, settings, job_id, cursor)
            for message in messages:
                yield message
            if terminal and not messages:
                # no id: the last message's id is where a reconnect resumes, and ids name one message each
                yield {"event": "end", "data": json.dumps({"job_id": job_id})}
                return
            if not messages:
                await waiter.wait()
