"""Webhooks: POST a signed message to a team's endpoints when its jobs end (and, if asked, on each checkpoint).

Outbox style, so nothing on the request path or in the worker's ingest loop ever waits for a receiver: every state
change and checkpoint is already an ``events`` row written in the same transaction as the change. The API's sender
loop (``run_once``, every ``webhook_poll_s``) fans new events out into ``webhook_deliveries`` rows (a per-endpoint
cursor advanced by compare-and-set, plus a unique (webhook, event) key, so several API processes never duplicate a
message), then POSTs the due ones from a small thread pool. Each POST is a ``webhook_attempts`` row; a non-2xx answer
or a connection error is retried after ``webhook_backoff_s * 2**(n-1)`` (capped at 1 h) up to ``webhook_max_attempts``.

Signing follows Standard Webhooks (as OpenAI's fine-tuning webhooks do): headers ``webhook-id`` (the message id, the
same on every retry), ``webhook-timestamp`` (unix seconds of this attempt) and ``webhook-signature``
``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`` keyed with the base64-decoded part of ``whsec_<base64>``,
computed by the reference library (``standardwebhooks``) that receivers verify with.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Literal, get_args

import httpx
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from standardwebhooks.webhooks import Webhook as StandardWebhook

from core import net_guard, secrets_box
from core.db import session_scope
from core.leadership import Leadership, run_when_leader
from core.models import Event, Job, Webhook, WebhookAttempt, WebhookDelivery, utcnow
from core.pages import fetch_page
from core.settings import Settings
from core.states import DeliveryState, sources

log = logging.getLogger(__name__)
EventType = Literal["job.succeeded", "job.failed", "job.cancelled", "job.checkpoint"]
TERMINAL_EVENTS: tuple[EventType, ...] = ("job.succeeded", "job.failed", "job.cancelled")
EVENT_TYPES: tuple[EventType, ...] = get_args(EventType)
SECRET_PREFIX = "whsec_"
FAN_OUT_BATCH = 500
SEND_BATCH = 32
MAX_BACKOFF_S = 3600.0
USER_AGENT = "llmjobs-webhooks/1"


# ---------------------------------------------------------------- signing (Standard Webhooks)


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a ``whsec_<base64>`` secret; ValueError names the field when it is not one."""
    try:
        key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    except (ValueError, TypeError) as err:
        raise ValueError("secret: must be whsec_ followed by base64") from err
    if not secret.startswith(SECRET_PREFIX) or not 24 <= len(key) <= 64:
        raise ValueError("secret: must be whsec_ followed by the base64 of 24 to 64 random bytes")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``."""
    when = datetime.fromtimestamp(timestamp, tz=timezone.utc)
    return StandardWebhook(secret_key(secret)).sign(msg_id, when, body.decode())


def headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id, timestamp, body),
    }


# ---------------------------------------------------------------- events -> deliveries


def event_type(event: Event) -> str | None:
    """The webhook type of an ``events`` row, or None when it is not one we announce."""
    if event.type == "checkpoint":
        return "job.checkpoint"
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


# ---------------------------------------------------------------- sending


@dataclass
class Outgoing:
    delivery_id: str
    number: int
    url: str
    secret: str
    body: bytes


def claim_due(settings: Settings, limit: int = SEND_BATCH) -> list[Outgoing]:
    """Due pending deliveries of enabled webhooks, each claimed by pushing its next_attempt_at past the POST's timeout
    (a compare-and-set: another sender skips it; a sender that dies leaves it due again)."""
    now = utcnow()
    hold = now + timedelta(seconds=settings.webhook_timeout_s + 30)
    out, key_list = [], secrets_box.keys(settings)
    with session_scope(settings.database_url) as session:
        due = session.execute(
            select(WebhookDelivery, Webhook)
            .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
            .where(
                WebhookDelivery.state == DeliveryState.pending.value,
                WebhookDelivery.next_attempt_at <= now,
                Webhook.disabled_at.is_(None),
            )
            .order_by(WebhookDelivery.next_attempt_at)
            .limit(limit)
        ).tuples()
        for delivery, hook in list(due):
            took = session.execute(
                update(WebhookDelivery)
                .where(
                    WebhookDelivery.id == delivery.id,
                    WebhookDelivery.state == DeliveryState.pending.value,
                    WebhookDelivery.attempts == delivery.attempts,
                    WebhookDelivery.next_attempt_at <= now,
                )
                .values(next_attempt_at=hold)
                .execution_options(synchronize_session=False)
            )
            if took.rowcount == 1:  # type: ignore[attr-defined]
                body = json.dumps(delivery.payload, separators=(",", ":")).encode()
                secret = secrets_box.unseal(key_list, hook.secret)
                out.append(Outgoing(delivery.id, delivery.attempts + 1, hook.url, secret, body))
        session.commit()
    return out


def post(settings: Settings, item: Outgoing) -> tuple[int | None, str | None, str | None, float]:
    """One POST to the address checked just now (``net_guard.pin``): (status, coarse error, first 500 characters of
    the answer, milliseconds). Tenants see only the coarse error; the detail goes to the server log."""
    started = time.monotonic()
    try:
        target = net_guard.pin(item.url, settings)
        with httpx.Client(timeout=settings.webhook_timeout_s, follow_redirects=False, trust_env=False) as client:
            response = client.post(
                target.url,
                content=item.body,
                extensions={"sni_hostname": target.host},
                headers={
                    **headers(item.secret, item.delivery_id, int(time.time()), item.body),
                    "host": target.host_header,
                },
            )
        return response.status_code, None, response.text[:500], (time.monotonic() - started) * 1000
    except net_guard.Blocked as err:
        log.warning("webhook %s not sent: %s", item.delivery_id, err)
        return None, net_guard.BLOCKED_REASON, None, (time.monotonic() - started) * 1000
    except httpx.HTTPError as err:
        log.info("webhook %s: %s: %s", item.delivery_id, type(err).__name__, err)
        return None, coarse_error(err), None, (time.monotonic() - started) * 1000


def coarse_error(err: httpx.HTTPError) -> str:
    """What a tenant may learn of a failed POST: not which port answered how (that would be a port scanner)."""
    return "timed out" if isinstance(err, httpx.TimeoutException) else "connection failed"


def backoff_s(settings: Settings, attempts: int) -> float:
    return min(settings.webhook_backoff_s * 2 ** (attempts - 1), MAX_BACKOFF_S)


def record(
    settings: Settings, item: Outgoing, status: int | None, error: str | None, answer: str | None, ms: float
) -> str:
    """Store the attempt and decide: delivered (2xx), failed (attempts used up) or pending again later."""
    now, ok = utcnow(), status is not None and 200 <= status < 300
    values: dict[str, Any]
    if ok:
        state, values = DeliveryState.delivered, {"delivered_at": now, "next_attempt_at": None}
    elif item.number >= settings.webhook_max_attempts:
        state, values = DeliveryState.failed, {"next_attempt_at": None}
    else:
        state = DeliveryState.pending
        values = {"next_attempt_at": now + timedelta(seconds=backoff_s(settings, item.number))}
    with session_scope(settings.database_url) as session:
        session.add(
            WebhookAttempt(
                delivery_id=item.delivery_id,
                number=item.number,
                time=now,
                status_code=status,
                error=error,
                response_body=answer,
                duration_ms=round(ms, 1),
            )
        )
        # Compare-and-set: only the sender that claimed this attempt (attempts still one less) records it.
        session.execute(
            update(WebhookDelivery)
            .where(
                WebhookDelivery.id == item.delivery_id,
                WebhookDelivery.state.in_(sources(state)),
                WebhookDelivery.attempts == item.number - 1,
            )
            .values(state=state.value, attempts=item.number, last_status=status, **values)
        )
    return state.value


def deliver(settings: Settings, item: Outgoing) -> str:
    return record(settings, item, *post(settings, item))


def run_once(settings: Settings, pool: ThreadPoolExecutor | None = None, watermark: Watermark | None = None) -> int:
    """Fan out new events, then POST every due delivery (concurrently in ``pool``). Returns how many were POSTed."""
    fan_out(settings, watermark or Watermark(settings.webhook_settle_s))
    due = claim_due(settings)
    if pool is None:
        return len([deliver(settings, item) for item in due])
    return len(list(pool.map(lambda item: deliver(settings, item), due)))


class Sender:
    """The API's background sender: ``run_once`` every ``webhook_poll_s`` in a thread (never on the event loop)."""

    def __init__(self, settings: Settings, workers: int = 4):
        self.settings = settings
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="webhook")
        self.watermark = Watermark(settings.webhook_settle_s)

    def tick(self) -> int:
        try:
            return run_once(self.settings, self.pool, self.watermark)
        except Exception as err:  # noqa: BLE001 - a database blip must not stop the sender
            log.warning("webhook pass failed: %s", err)
            return 0

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------- registrations


def create_webhook(
    session: Session,
    team: str,
    url: str,
    events: list[str],
    secret: str | None,
    description: str | None,
    *,
    settings: Settings,
) -> tuple[Webhook, str]:
    """A new endpoint and its secret in clear (stored sealed, ``core.secrets_box``); it gets the events after this
    moment (its cursor starts at the newest event)."""
    secret = secret or new_secret()
    hook = Webhook(
        team=team,
        url=url,
        events=list(dict.fromkeys(events)),
        secret=secrets_box.seal(secrets_box.keys(settings), secret),
        description=description,
        cursor=session.scalar(select(func.max(Event.id))) or 0,
    )
    session.add(hook)
    session.commit()
    return hook, secret


def reseal_secrets(session: Session, settings: Settings) -> int:
    """Re-encrypt every stored webhook secret under the newest of ``secret_keys`` (after a key was put first), so
    older keys can be dropped; a secret still in clear is sealed. All or nothing: ValueError naming the webhooks no
    key in force opens, and nothing is changed. Returns how many were re-encrypted."""
    key_list = secrets_box.keys(settings)
    hooks = list(session.scalars(select(Webhook).order_by(Webhook.id)))
    resealed: dict[str, str] = {}
    unopened: list[str] = []
    for hook in hooks:
        try:
            resealed[hook.id] = (
                secrets_box.reseal(key_list, hook.secret)
                if secrets_box.is_sealed(hook.secret)
                else secrets_box.seal(key_list, hook.secret)
            )
        except ValueError:
            unopened.append(hook.id)
    if unopened:
        raise ValueError(
            f"{len(unopened)} webhook secret(s) open with none of secret_keys (webhooks "
            f"{', '.join(unopened[:10])}); put back the key they were sealed with"
        )
    for hook in hooks:
        hook.secret = resealed[hook.id]
    session.commit()
    return len(hooks)


def team_webhooks(session: Session, team: str) -> list[Webhook]:
    """A team's endpoints, oldest first."""
    return list(session.scalars(select(Webhook).where(Webhook.team == team).order_by(Webhook.created_at, Webhook.id)))


def disable_webhook(session: Session, hook: Webhook) -> Webhook:
    """Stop sending to it (pending messages are not sent); its delivery history stays."""
    if hook.disabled_at is None:
        hook.disabled_at = utcnow()
        session.commit()
    return hook


def deliveries_page(
    session: Session, webhook_id: str, *, job_id: str | None, limit: int
) -> tuple[list[tuple[WebhookDelivery, list[WebhookAttempt]]], bool]:
    """An endpoint's deliveries, newest first, each with its attempts in order."""
    query = select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)
    if job_id:
        query = query.where(WebhookDelivery.job_id == job_id)
    rows, has_more = fetch_page(session, query.order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id), limit)
    attempts = [
        list(
            session.scalars(
                select(WebhookAttempt).where(WebhookAttempt.delivery_id == row.id).order_by(WebhookAttempt.number)
            )
        )
        for row in rows
    ]
    return list(zip(rows, attempts, strict=True)), has_more


async def send_forever(settings: Settings, leader: Leadership | None = None) -> None:
    """The API lifespan's task: a sender pass every ``webhook_poll_s``, run in a thread, in the leading replica."""
    sender = Sender(settings)
    try:
        await run_when_leader(
            leader or Leadership(settings.database_url), settings.webhook_poll_s, sender.tick, "webhook pass"
        )
    finally:
        sender.close()
