"""A team's secrets (values the service uses for it, never answered back: ``core.team_secrets``) and its default
``report_to`` (set by an admin, filled into train specs that set none: ``core.tracking``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import PrincipalDep, SessionDep, SettingsDep
from app.schemas import FromRow, ListPage
from core import team_secrets, tracking
from core.auth import Principal
from core.errors import ApiError

secrets_router = APIRouter(prefix="/v1/secrets", tags=["secrets"])
teams_router = APIRouter(prefix="/v1/teams", tags=["teams"])
ERRORS: dict[int | str, dict[str, Any]] = {401: {"description": "No or bad token"}}
SecretName = Annotated[str, Path(max_length=100, pattern=team_secrets.NAME_PATTERN)]
TeamName = Annotated[str, Path(max_length=64)]


class SecretValue(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: str = Field(min_length=1, max_length=team_secrets.MAX_VALUE, description="Stored encrypted; never shown.")


class SecretPublic(FromRow):
    object: Literal["secret"] = "secret"
    name: str
    team: str
    created_at: datetime
    updated_at: datetime


class TeamTrackingBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    report_to: list[Literal["mlflow"]] = Field(default_factory=list, description="Trackers every train job reports to.")
    mlflow_tracking_uri: str | None = Field(None, max_length=2000, pattern=r"^https?://[^\s]+$")
    mlflow_experiment: str | None = Field(None, min_length=1, max_length=500)
    mlflow_token_secret: str | None = Field(
        None, pattern=team_secrets.NAME_PATTERN, description="A team secret's name."
    )


class TeamTrackingPublic(TeamTrackingBody, FromRow):
    object: Literal["team_tracking"] = "team_tracking"
    team: str


@secrets_router.put("/{name}", response_model=SecretPublic, responses=ERRORS)
def put_secret(
    name: SecretName, body: SecretValue, session: SessionDep, principal: PrincipalDep, settings: SettingsDep
) -> SecretPublic:
    """Store (or replace) a secret of your team; a spec names it (``mlflow_token_secret``), never holds its value."""
    return SecretPublic.model_validate(team_secrets.put(session, settings, principal.team, name, body.value))


@secrets_router.get("", response_model=ListPage[SecretPublic], responses=ERRORS)
def list_secrets(session: SessionDep, principal: PrincipalDep) -> ListPage[SecretPublic]:
    """Your team's secrets, by name (their values are never answered)."""
    rows = team_secrets.listing(session, principal.team)
    return ListPage[SecretPublic].of([SecretPublic.model_validate(r) for r in rows], False, key=lambda s: s.name)


@secrets_router.delete("/{name}", status_code=204, responses={**ERRORS, 404: {"description": "No such secret"}})
def delete_secret(name: SecretName, session: SessionDep, principal: PrincipalDep) -> Response:
    if not team_secrets.remove(session, principal.team, name):
        raise ApiError(404, "not_found", f"no secret named {name!r} in your team", "name")
    return Response(status_code=204)


def _visible_team(principal: Principal, team: str) -> None:
    if not principal.sees(team):
        raise ApiError(404, "not_found", f"no team {team!r} visible to this token", "team")


@teams_router.get("/{team}/tracking", response_model=TeamTrackingPublic, responses=ERRORS)
def get_team_tracking(team: TeamName, session: SessionDep, principal: PrincipalDep) -> TeamTrackingPublic:
    """The team's default report_to: what a train spec that sets none of these fields gets."""
    _visible_team(principal, team)
    return TeamTrackingPublic(team=team, **tracking.team_default(session, team))


@teams_router.put(
    "/{team}/tracking",
    response_model=TeamTrackingPublic,
    responses={**ERRORS, 403: {"description": "Not an admin token"}, 422: {"description": "A field refused"}},
)
def put_team_tracking(
    team: TeamName, body: TeamTrackingBody, session: SessionDep, principal: PrincipalDep, settings: SettingsDep
) -> TeamTrackingPublic:
    """Set the team's default report_to (admin tokens only); checked as a spec's fields are."""
    if not principal.admin:
        raise ApiError(403, "forbidden", "only an admin token sets a team's tracking default", None)
    fields = body.model_dump()
    tracking.set_team_default(session, settings, team, fields)
    return TeamTrackingPublic(team=team, **fields)
