"""API tokens: random bearer secrets, stored only as SHA-256 hashes, each bound to one team."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import ApiToken

TOKEN_PREFIX = "llmj_"


@dataclass(frozen=True)
class Principal:
    team: str
    admin: bool
    token_id: int


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, *, team: str, name: str | None = None, admin: bool = False) -> str:
    """Store a new token's hash and return the token itself (shown once)."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(token_hash=hash_token(token), prefix=token[:12], team=team, name=name, admin=admin))
    session.flush()
    return token


def authenticate(session: Session, token: str) -> Principal | None:
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None)))
    if row is None:
        return None
    return Principal(team=row.team, admin=row.admin, token_id=row.id)
