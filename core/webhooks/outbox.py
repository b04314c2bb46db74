"""Events -> deliveries: new ``events`` rows fanned out into ``webhook_deliveries`` rows, one per (endpoint, event).

A per-endpoint cursor advanced by compare-and-set, plus a unique (webhook, event) key, so several API processes never
duplicate a message; ``Watermark`` keeps a cursor from jumping over a transaction still open.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from datetime import datetime
from typing import Any, Literal, get_args

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db import session_scope
from core.models import Event, Job, Webhook, WebhookDelivery, utcnow
from core.settings import Settings
from core.states import DeliveryState

EventType = Literal["job.succeeded", "job.failed", "job.cancelled", "job.checkpoint", "job.disk_low"]
TERMINAL_EVENTS: tuple[EventType, ...] = ("job.succeeded", "job.failed", "job.cancelled")
EVENT_TYPES: tuple[EventType, ...] = get_args(EventType)
FAN_OUT_BATCH = 500


def event_type(event: Event) -> str | None:
    """The webhook type of an ``events`` row, or None when it is not one we announce."""
    if event.type == "checkpoint":
        return "job.checkpoint"
    if event.type == "disk_low":  # a data root the running job writes to is nearly full (core.disk_watch)
        return "job.disk_low"
    state = (event.data or {}).get("state") if event.type == "state" else None
    return f"job.{state}" if f"job.{state}" in TERMINAL_EVENTS else None


def payload(msg_type: str, event: Event, job: Job) -> dict[str, Any]:
    """OpenAI's shape: {object, id, type, created_at, data}; data carries the job's essentials."""
    data: dict[str, Any] = {
        "id": job.id,
        "object": "job",
        "kind": job.kind,
        "name": job.name,
        "state": job.state,
        "parent_id": job.parent_id,
        "metadata": job.meta or {},
    }
    if msg_type == "job.checkpoint":
        data.update(
            state="running", checkpoint={k: v for k, v in (event.data or {}).items() if k in ("iteration", "path")}
        )
    else:
        data["state"] = msg_type.removeprefix("job.")
        if msg_type == "job.failed":
            data["error"] = {"code": job.error_code, "message": job.error_message}
        if msg_type == "job.succeeded":
            data["outputs"] = (job.result or {}).get("outputs") or {}
    return {
        "object": "event",
        "id": f"evt_{event.id}",
        "type": msg_type,
        "created_at": int(event.time.timestamp()),
        "data": data,
    }


class Watermark:
    """The events.id up to which every transaction has committed: max(events.id) as it was ``settle_s`` ago.

    PostgreSQL hands out ids at insert but rows appear at commit, so a transaction still open may commit an id below
    the max seen now; fanning out only up to the max seen ``webhook_settle_s`` ago (longer than any transaction that
    writes events) keeps a webhook's cursor from jumping over it. SQLite has one writer, so there ids appear in order.
    """

    def __init__(self, settle_s: float):
        self.settle_s, self.safe = settle_s, 0
        self.seen: deque[tuple[float, int]] = deque()

    def update(self, current: int, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        self.seen.append((now, current))
        while self.seen and now - self.seen[0][0] >= self.settle_s:
            self.safe = max(self.safe, self.seen.popleft()[1])
        return self.safe


def _fan_out_one(session: Session, hook: Webhook, top: int, now: datetime) -> int:
    if top <= hook.cursor:
        return 0
    rows = list(
        session.execute(
            select(Event, Job)
            .join(Job, Job.id == Event.job_id)
            .where(
                Event.id > hook.cursor, Event.id <= top, Event.type.in_(("state", "checkpoint")), Job.team == hook.team
            )
            .order_by(Event.id)
            .limit(FAN_OUT_BATCH)
        ).tuples()
    )
    cursor = rows[-1][0].id if len(rows) == FAN_OUT_BATCH else top
    moved = session.execute(
        update(Webhook)
        .where(Webhook.id == hook.id, Webhook.cursor == hook.cursor)
        .values(cursor=cursor)
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount != 1:  # type: ignore[attr-defined]  # another sender took this batch
        session.rollback()
        return 0
    made = 0
    for event, job in rows:
        msg_type = event_type(event)
        if msg_type is None or msg_type not in hook.events:
            continue
        session.add(
            WebhookDelivery(
                id=f"msg_{uuid.uuid4().hex}",
                webhook_id=hook.id,
                event_id=event.id,
                job_id=job.id,
                type=msg_type,
                payload=payload(msg_type, event, job),
                state=DeliveryState.pending.value,
                next_attempt_at=now,
                created_at=now,
            )
        )
        made += 1
    try:
        session.commit()
    except IntegrityError:  # a delivery for this (webhook, event) exists already
        session.rollback()
        return 0
    return made


def fan_out(settings: Settings, watermark: Watermark) -> int:
    """New events -> pending deliveries for every enabled webhook of the events' teams. Returns how many."""
    made = 0
    with session_scope(settings.database_url) as session:
        top = watermark.update(session.scalar(select(func.max(Event.id))) or 0)
        hooks = list(session.scalars(select(Webhook).where(Webhook.disabled_at.is_(None))))
        for hook in hooks:
            made += _fan_out_one(session, hook, top, utcnow())
    return made
