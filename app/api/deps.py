"""Request dependencies as named aliases: routes declare ``SessionDep``, ``PrincipalDep``, ``SettingsDep``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.auth_first import BAD_TOKEN, BEARER_CHALLENGE, MISSING_TOKEN
from core.auth import Principal, authenticate
from core.db import get_sessionmaker
from core.errors import ApiError
from core.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="An API token from `llmjobs token create --team T`.")


def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    session = get_sessionmaker(settings.database_url)()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]


def get_principal(
    request: Request,
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """The caller: as ``app.auth_first`` found it before the body was read, or (where that middleware did not run)
    looked up here. ``_bearer`` stays a dependency: it is what marks the route as needing a token, for the OpenAPI
    document and for the middleware."""
    known = getattr(request.state, "principal", None)
    if isinstance(known, Principal):
        return known
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise ApiError(401, "unauthorized", MISSING_TOKEN, "Authorization", BEARER_CHALLENGE)
    principal = authenticate(session, credentials.credentials)
    session.commit()  # hand the connection back: a route that reads a slow body or streams must not hold it
    if principal is None:
        raise ApiError(401, "unauthorized", BAD_TOKEN, "Authorization", BEARER_CHALLENGE)
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]
