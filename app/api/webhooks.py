"""Webhook endpoints of a team: register, list, show, disable, and every delivery with its attempts."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, field_validator
from sqlalchemy.orm import Session

from app.api.deps import PrincipalDep, SessionDep, SettingsDep
from app.schemas import FromRow, ListPage
from core.auth import Principal, load_visible
from core.models import Webhook
from core.webhook_rules import check_registration
from core.webhooks import (
    TERMINAL_EVENTS,
    EventType,
    create_webhook,
    deliveries_page,
    disable_webhook,
    secret_key,
    team_webhooks,
)

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"description": "No or bad token"},
    404: {"description": "No such webhook"},
    409: {"description": "The team has webhook_max_per_team webhooks"},
}


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: AnyHttpUrl = Field(description="http(s) endpoint that receives a POST per event")
    events: list[EventType] = Field(
        default_factory=lambda: list(TERMINAL_EVENTS),
        min_length=1,
        description="which events to send; default: the three terminal states",
    )
    secret: str | None = Field(None, description="whsec_<base64 of 24-64 bytes>; generated when omitted")
    description: str | None = Field(None, max_length=200)

    @field_validator("secret")
    @classmethod
    def _check_secret(cls, value: str | None) -> str | None:
        if value is not None:
            secret_key(value)
        return value


class WebhookPublic(FromRow):
    object: Literal["webhook"] = "webhook"
    id: str
    team: str
    url: str
    events: list[str]
    description: str | None
    secret: str | None = Field(
        None, description="only in the answer to POST /v1/webhooks: keep it to verify signatures"
    )
    created_at: datetime
    disabled_at: datetime | None


class AttemptPublic(FromRow):
    number: int
    time: datetime
    status_code: int | None
    error: str | None
    duration_ms: float


class DeliveryPublic(FromRow):
    object: Literal["webhook.delivery"] = "webhook.delivery"
    id: str = Field(description="the webhook-id header of every attempt")
    type: str
    job_id: str
    state: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status: int | None
    next_attempt_at: datetime | None
    created_at: datetime
    delivered_at: datetime | None
    payload: dict[str, Any]
    attempt_log: list[AttemptPublic]


def _public(hook: Webhook) -> WebhookPublic:
    public = WebhookPublic.model_validate(hook)
    public.secret = None  # stored sealed; shown in clear only in the answer to POST
    return public


def _visible(session: Session, webhook_id: str, principal: Principal) -> Webhook:
    return load_visible(session, Webhook, webhook_id, principal, "webhook")


@router.post("", status_code=201, response_model=WebhookPublic, responses=ERRORS)
def register(body: WebhookCreate, session: SessionDep, principal: PrincipalDep, settings: SettingsDep) -> WebhookPublic:
    """Send your team's job events to ``url``, signed Standard-Webhooks style (the secret is shown only here).

    ``url`` must be https and resolve to a public address (internal receivers: an admin lists them in settings)."""
    check_registration(session, settings, principal.team, str(body.url))
    hook, secret = create_webhook(
        session, principal.team, str(body.url), list(body.events), body.secret, body.description, settings=settings
    )
    public = _public(hook)
    public.secret = secret
    return public


@router.get("", response_model=ListPage[WebhookPublic], responses=ERRORS)
def list_webhooks(session: SessionDep, principal: PrincipalDep) -> ListPage[WebhookPublic]:
    """Your team's webhooks, oldest first (secrets are not shown)."""
    return ListPage[WebhookPublic].of([_public(h) for h in team_webhooks(session, principal.team)])


@router.get("/{webhook_id}", response_model=WebhookPublic, responses=ERRORS)
def get_webhook(webhook_id: str, session: SessionDep, principal: PrincipalDep) -> WebhookPublic:
    return _public(_visible(session, webhook_id, principal))


@router.delete("/{webhook_id}", response_model=WebhookPublic, responses=ERRORS)
def disable(webhook_id: str, session: SessionDep, principal: PrincipalDep) -> WebhookPublic:
    """Stop sending (pending messages are not sent); the delivery history stays readable."""
    return _public(disable_webhook(session, _visible(session, webhook_id, principal)))


@router.get("/{webhook_id}/deliveries", response_model=ListPage[DeliveryPublic], responses=ERRORS)
def deliveries(
    webhook_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    job_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> ListPage[DeliveryPublic]:
    """Newest first, each with every attempt (status or error, duration)."""
    _visible(session, webhook_id, principal)
    rows, has_more = deliveries_page(session, webhook_id, job_id=job_id, limit=limit)
    data = []
    for row, attempts in rows:
        data.append(
            DeliveryPublic.model_validate(
                {
                    **{k: getattr(row, k) for k in DeliveryPublic.model_fields if k not in ("object", "attempt_log")},
                    "attempt_log": [AttemptPublic.model_validate(a) for a in attempts],
                }
            )
        )
    return ListPage[DeliveryPublic].of(data, has_more)
