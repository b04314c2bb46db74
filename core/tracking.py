"""``report_to`` at submission: where a train job (a pipeline's train step, a sweep's base spec) asks to be mirrored
is checked before anything is stored, so a refused address is a 422 naming the field, not a warning event later.

The address follows the webhook rule (``core.net_guard``: https to a public address, internal hosts only when an
admin lists them in ``webhook_allowed_hosts``); ``core.mlflow_report`` checks it again at every send, so a DNS answer
that changes after submission is still never followed.
"""

from __future__ import annotations

from typing import Any

from core import net_guard
from core.errors import ApiError
from core.settings import Settings
from engine.contract.spec import JobBase, PipelineSpec, TrainSpec

FIELD = "mlflow_tracking_uri"


def check_uri(settings: Settings, uri: str | None, where: str = "") -> None:
    """422 naming ``<where>mlflow_tracking_uri`` when the service may not send to ``uri``."""
    if not uri:
        return
    try:
        net_guard.check_url(uri, settings)
    except net_guard.Blocked as err:
        reason = str(err).removeprefix("url:").strip()
        raise ApiError(422, "validation_error", f"{where}{FIELD}: {reason}", f"{where}{FIELD}") from err


def _step_uri(step: dict[str, Any]) -> str | None:
    uri = step.get(FIELD)
    return uri if isinstance(uri, str) else None


def check_spec(settings: Settings, spec: JobBase) -> None:
    """The tracking address of a train spec, or of each train step of a pipeline."""
    if isinstance(spec, TrainSpec):
        check_uri(settings, spec.mlflow_tracking_uri)
    elif isinstance(spec, PipelineSpec):
        for i, step in enumerate(spec.steps):
            check_uri(settings, _step_uri(step.spec), f"steps.{i}.spec.")
