"""``report_to`` at submission: a train job (a pipeline's train step, a sweep's base spec) takes the team's tracking
defaults where it sets nothing, then where it asks to be mirrored is checked before anything is stored, so a refused
address or a missing token secret is a 422 naming the field, not a warning event later.

The team's defaults (``team_tracking``, set by an admin) fill the spec field by field: the spec's own fields win,
``report_to: []`` opts out. The address follows the webhook rule (``core.net_guard``: https to a public address,
internal hosts only when an admin lists them in ``webhook_allowed_hosts``); ``core.mlflow_report`` checks it again at
every send, so a DNS answer that changes after submission is still never followed. The token is a team secret named
by ``mlflow_token_secret`` (``core.team_secrets``), opened only by the mirror when it sends.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from core import net_guard, team_secrets
from core.errors import ApiError
from core.models import TeamTracking, utcnow
from core.settings import Settings
from engine.contract.spec import JobBase, PipelineSpec, TrainSpec

FIELDS = ("report_to", "mlflow_tracking_uri", "mlflow_experiment", "mlflow_token_secret")


def _refuse(field: str, message: str) -> ApiError:
    return ApiError(422, "validation_error", f"{field}: {message}", field)


def check_uri(settings: Settings, uri: str | None, where: str = "") -> None:
    """422 naming ``<where>mlflow_tracking_uri`` when the service may not send to ``uri``."""
    if not uri:
        return
    try:
        net_guard.check_url(uri, settings)
    except net_guard.Blocked as err:
        raise _refuse(f"{where}mlflow_tracking_uri", str(err).removeprefix("url:").strip()) from err


def check_fields(session: Session, settings: Settings, team: str, fields: dict[str, Any], where: str = "") -> None:
    """The four fields (a spec's, after the defaults; or a team setting's) as the mirror will use them."""
    if "mlflow" in (fields.get("report_to") or ()) and not fields.get("mlflow_tracking_uri"):
        raise _refuse(f"{where}mlflow_tracking_uri", 'required with report_to ["mlflow"] (or in the team\'s default)')
    check_uri(settings, fields.get("mlflow_tracking_uri"), where)
    secret = fields.get("mlflow_token_secret")
    if isinstance(secret, str) and not team_secrets.exists(session, team, secret):
        raise _refuse(f"{where}mlflow_token_secret", f"the team has no secret named {secret!r} (PUT /v1/secrets/NAME)")


def team_default(session: Session, team: str) -> dict[str, Any]:
    """The team's default fields, only those it sets."""
    row = session.get(TeamTracking, team)
    if row is None:
        return {}
    values = {name: getattr(row, name) for name in FIELDS}
    return {k: v for k, v in values.items() if v not in (None, [])}


def with_defaults(spec: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    """``spec`` (a raw train spec) with the default's fields it does not set."""
    return {**{k: v for k, v in default.items() if k not in spec}, **spec}


def fill(session: Session, team: str, spec: JobBase) -> None:
    """A train spec's unset tracking fields from the team's default (stored with the spec): at submission, and for
    each pipeline step and sweep trial as it is created."""
    if isinstance(spec, TrainSpec):
        for name, value in team_default(session, team).items():
            if name not in spec.model_fields_set:
                setattr(spec, name, value)  # assignment marks the field set: the stored spec keeps it


def prepare(session: Session, settings: Settings, team: str, spec: JobBase) -> None:
    """At submission: a train spec filled and checked; each train step of a pipeline checked as it will be filled."""
    fill(session, team, spec)
    if isinstance(spec, TrainSpec):
        check_fields(session, settings, team, {name: getattr(spec, name) for name in FIELDS})
    elif isinstance(spec, PipelineSpec):
        default = team_default(session, team)
        for i, step in enumerate(spec.steps):
            if step.spec.get("kind") == "train":
                check_fields(session, settings, team, with_defaults(step.spec, default), f"steps.{i}.spec.")


def check_sweep_base(session: Session, settings: Settings, team: str, base: dict[str, Any]) -> None:
    check_fields(session, settings, team, with_defaults(base, team_default(session, team)), "base.")


def set_team_default(session: Session, settings: Settings, team: str, fields: dict[str, Any]) -> TeamTracking:
    """Replace the team's default (checked as a spec's would be)."""
    check_fields(session, settings, team, fields)
    row = session.get(TeamTracking, team) or TeamTracking(team=team)
    for name in FIELDS:
        setattr(row, name, fields.get(name) if name != "report_to" else list(fields.get(name) or []))
    row.updated_at = utcnow()
    session.add(row)
    session.commit()
    return row
