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

The parts: ``signing`` (Standard Webhooks headers), ``outbox`` (events -> deliveries), ``sender`` (claim, POST,
record, retry; the API's loop) and ``registry`` (a team's endpoints). This module is their public face.
"""

from core.webhooks.outbox import EVENT_TYPES, TERMINAL_EVENTS, EventType, Watermark, event_type, fan_out, payload
from core.webhooks.registry import create_webhook, deliveries_page, disable_webhook, reseal_secrets, team_webhooks
from core.webhooks.sender import Outgoing, Sender, claim_due, deliver, post, record, run_once, send_forever
from core.webhooks.signing import SECRET_PREFIX, headers, new_secret, secret_key, sign

__all__ = [
    "EVENT_TYPES",
    "SECRET_PREFIX",
    "TERMINAL_EVENTS",
    "EventType",
    "Outgoing",
    "Sender",
    "Watermark",
    "claim_due",
    "create_webhook",
    "deliver",
    "deliveries_page",
    "disable_webhook",
    "event_type",
    "fan_out",
    "headers",
    "new_secret",
    "payload",
    "post",
    "record",
    "reseal_secrets",
    "run_once",
    "secret_key",
    "send_forever",
    "sign",
    "team_webhooks",
]
