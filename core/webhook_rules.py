"""What a team may register as a webhook: a URL ``net_guard`` accepts, and at most ``webhook_max_per_team`` enabled."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core import net_guard
from core.errors import ApiError
from core.models import Webhook
from core.settings import Settings


def check_registration(session: Session, settings: Settings, team: str, url: str) -> None:
    """Raise the API's 422 (bad URL, naming ``url``) or 409 (team at its webhook cap) before anything is stored."""
    try:
        net_guard.check_url(url, settings)
    except net_guard.Blocked as err:
        raise ApiError(422, "validation_error", str(err), "url") from err
    count = (
        session.scalar(
            select(func.count()).select_from(Webhook).where(Webhook.team == team, Webhook.disabled_at.is_(None))
        )
        or 0
    )
    if count >= settings.webhook_max_per_team:
        raise ApiError(
            409,
            "too_many_webhooks",
            f"the team has {count} enabled webhooks, the most allowed (webhook_max_per_team); disable one first",
            "url",
        )
