"""API tokens: random bearer secrets, stored only as SHA-256 hashes, each bound to one team."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Protocol, TypeVar

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from core.errors import ApiError
from core.models import ApiToken, utcnow
from core.paths import check_team_name

TOKEN_PREFIX = "llmj_"


@dataclass(frozen=True)
class Principal:
    team: str
    admin: bool
    token_id: int

    def sees(self, team: str | None) -> bool:
        """Whether this principal may see what ``team`` owns (its own team's; an admin sees every team's)."""
        return self.admin or team == self.team


class Owned(Protocol):
    team: str


O = TypeVar("O", bound=Owned)


def load_visible(session: Session, model: type[O], key: str, principal: Principal, what: str) -> O:
    """The row ``key`` of ``model`` if this principal sees its team; otherwise 404 (never 403: no existence leak)."""
    row = session.get(model, key)
    if row is None or not principal.sees(row.team):
        raise ApiError(404, "not_found", f"no {what} {key}", "id")
    return row


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, *, team: str, name: str | None = None, admin: bool = False) -> str:
    """Store a new token's hash and return the token itself (shown once); ValueError for a team name that cannot name
    the team's data directory (``core.paths``)."""
    check_team_name(team)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(
        ApiToken(token_hash=hash_token(token), prefix=token[: len(TOKEN_PREFIX) + 7], team=team, name=name, admin=admin)
    )
    session.flush()
    return token


def authenticate(session: Session, token: str) -> Principal | None:
    row = session.scalar(
        select(ApiToken).where(ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None))
    )
    if row is None:
        return None
    return Principal(team=row.team, admin=row.admin, token_id=row.id)


def list_tokens(session: Session, team: str | None = None) -> list[ApiToken]:
    """Every token (or one team's), oldest first; the secrets themselves are not stored."""
    query = select(ApiToken).order_by(ApiToken.id)
    return list(session.scalars(query if team is None else query.where(ApiToken.team == team)))


def revoke_token(session: Session, ref: str) -> int:
    """Revoke the token named by ``ref``: its id, its 12-character prefix (as ``token list`` prints it) or the token
    itself. Returns how many were revoked (0 when none is active under that name); a prefix shared by two active
    tokens is refused, so one command never revokes a token it did not mean to."""
    match = ApiToken.token_hash == hash_token(ref)
    if ref.isdigit():
        match = or_(match, ApiToken.id == int(ref))
    elif len(ref) == len(TOKEN_PREFIX) + 7:
        match = or_(match, ApiToken.prefix == ref)
    live = list(session.scalars(select(ApiToken.id).where(match, ApiToken.revoked_at.is_(None))))
    if len(live) > 1:
        raise ValueError(f"{ref!r} matches {len(live)} tokens; give the token id")
    if live:
        session.execute(update(ApiToken).where(ApiToken.id == live[0]).values(revoked_at=utcnow()))
    return len(live)
