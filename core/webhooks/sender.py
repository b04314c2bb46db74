"""Sending: claim due deliveries, POST each to the address checked at that moment, record the attempt, retry later.

Each POST is a ``webhook_attempts`` row; a non-2xx answer or a connection error is retried after
``webhook_backoff_s * 2**(n-1)`` (capped at 1 h) up to ``webhook_max_attempts``. The API's sender loop
(``send_forever``: ``run_once`` every ``webhook_poll_s`` in the leading replica) runs the POSTs in a small thread pool.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
from sqlalchemy import func, select, update

from core import net_guard, secrets_box
from core.db import session_scope
from core.leadership import Leadership, run_when_leader
from core.models import Webhook, WebhookAttempt, WebhookDelivery, utcnow
from core.settings import Settings
from core.states import DeliveryState, sources
from core.webhooks.outbox import Watermark, fan_out
from core.webhooks.signing import headers

log = logging.getLogger("core.webhooks")
SEND_BATCH = 32
MAX_BACKOFF_S = 3600.0


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


def still_enabled(settings: Settings, delivery_id: str) -> bool:
    """Whether the webhook of this delivery is still enabled: a batch claimed before ``DELETE /v1/webhooks/{id}``
    (up to ``SEND_BATCH`` messages, each up to ``webhook_timeout_s``) must not keep sending after it."""
    with session_scope(settings.database_url) as session:
        found = session.scalar(
            select(func.count())
            .select_from(WebhookDelivery)
            .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
            .where(WebhookDelivery.id == delivery_id, Webhook.disabled_at.is_(None))
        )
    return bool(found)


def deliver(settings: Settings, item: Outgoing) -> str | None:
    """POST one claimed message and record the attempt; None (nothing sent, it stays pending and is never claimed
    again) when its webhook was deleted since the claim."""
    if not still_enabled(settings, item.delivery_id):
        return None
    return record(settings, item, *post(settings, item))


def run_once(settings: Settings, pool: ThreadPoolExecutor | None = None, watermark: Watermark | None = None) -> int:
    """Fan out new events, then POST every due delivery (concurrently in ``pool``). Returns how many were POSTed."""
    fan_out(settings, watermark or Watermark(settings.webhook_settle_s))
    due = claim_due(settings)
    if pool is None:
        results = [deliver(settings, item) for item in due]
    else:
        results = list(pool.map(lambda item: deliver(settings, item), due))
    return sum(result is not None for result in results)


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


async def send_forever(settings: Settings, leader: Leadership | None = None) -> None:
    """The API lifespan's task: a sender pass every ``webhook_poll_s``, run in a thread, in the leading replica."""
    sender = Sender(settings)
    try:
        await run_when_leader(
            leader or Leadership(settings.database_url), settings.webhook_poll_s, sender.tick, "webhook pass"
        )
    finally:
        sender.close()
