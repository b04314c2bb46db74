"""A team's named secrets: values the service uses on the team's behalf (the bearer token ``report_to`` sends to an
MLflow tracking server), so a spec names a secret and never holds the value.

Stored sealed by ``core.secrets_box`` (the webhook secrets' keys and rotation); written and deleted through the API
by the team's tokens, listed by name only, and opened only where the service sends them (``core.mlflow_report``).
"""

from __future__ import annotations

import re

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from core import secrets_box
from core.errors import ApiError
from core.models import TeamSecret, utcnow
from core.settings import Settings

NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]{0,99}$"
MAX_VALUE = 4096


def check_name(name: str, field: str = "name") -> None:
    if not re.fullmatch(NAME_PATTERN, name):
        raise ApiError(
            422, "validation_error", f"{field}: a secret name is a letter then up to 99 of A-Z a-z 0-9 _ . -", field
        )


def put(session: Session, settings: Settings, team: str, name: str, value: str) -> TeamSecret:
    """Create or replace ``name`` (sealed under the newest key)."""
    check_name(name)
    sealed = secrets_box.seal(secrets_box.keys(settings), value)
    row = session.get(TeamSecret, (team, name))
    if row is None:
        row = TeamSecret(team=team, name=name, value=sealed)
        session.add(row)
    else:
        row.value, row.updated_at = sealed, utcnow()
    session.commit()
    return row


def listing(session: Session, team: str) -> list[TeamSecret]:
    return list(session.scalars(select(TeamSecret).where(TeamSecret.team == team).order_by(TeamSecret.name)))


def exists(session: Session, team: str, name: str) -> bool:
    return session.get(TeamSecret, (team, name)) is not None


def remove(session: Session, team: str, name: str) -> bool:
    gone = session.execute(delete(TeamSecret).where(TeamSecret.team == team, TeamSecret.name == name))
    session.commit()
    return bool(gone.rowcount)  # type: ignore[attr-defined]


def reveal(session: Session, settings: Settings, team: str, name: str) -> str:
    """The value in clear, for the one request that sends it; ``ValueError`` naming the field when it is gone."""
    row = session.get(TeamSecret, (team, name))
    if row is None:
        raise ValueError(f"mlflow_token_secret: the team has no secret named {name!r} (deleted after submission?)")
    return secrets_box.unseal(secrets_box.keys(settings), row.value)


def reseal_all(session: Session, settings: Settings) -> int:
    """Every team secret under the newest key (``llmjobs reseal``); all or nothing, ``ValueError`` when one does not
    open with any key in force. Returns how many."""
    key_list = secrets_box.keys(settings)
    rows = list(session.scalars(select(TeamSecret)))
    try:
        resealed = [secrets_box.reseal(key_list, row.value) for row in rows]
    except ValueError as err:
        session.rollback()
        raise ValueError(f"a team secret opens with none of secret_keys; nothing re-sealed ({err})") from err
    for row, value in zip(rows, resealed, strict=True):
        row.value = value
    session.commit()
    return len(rows)
