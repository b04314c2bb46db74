"""Signing as Standard Webhooks does it (as OpenAI's fine-tuning webhooks do): headers ``webhook-id`` (the message id,
the same on every retry), ``webhook-timestamp`` (unix seconds of this attempt) and ``webhook-signature``
``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`` keyed with the base64-decoded part of ``whsec_<base64>``,
computed by the reference library (``standardwebhooks``) that receivers verify with.
"""

from __future__ import annotations

import base64
import secrets
from datetime import datetime, timezone

from standardwebhooks.webhooks import Webhook as StandardWebhook

SECRET_PREFIX = "whsec_"
USER_AGENT = "llmjobs-webhooks/1"


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
