"""A team's endpoints: create (the secret sealed at rest), list, disable, re-seal every secret, delivery history."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core import secrets_box
from core.models import Event, Webhook, WebhookAttempt, WebhookDelivery, utcnow
from core.pages import fetch_page
from core.settings import Settings
from core.webhooks.signing import new_secret


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
