"""Request dependencies as named aliases: routes declare ``SessionDep``, ``PrincipalDep``, ``SettingsDep``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

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
    session: SessionDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Principal:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise ApiError(401, "unauthorized", "missing bearer token (Authorization: Bearer <token>)", "Authorization")
    principal = authenticate(session, credentials.credentials)
    session.commit()  # hand the connection back: a route that reads a slow body or streams must not hold it
    if principal is None:
        raise ApiError(401, "unauthorized", "invalid or revoked token", "Authorization")
    return principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]
