"""Errors of the domain: ``ApiError`` (status, code, message, field) and pydantic errors as ``{code, message, field}``.

The HTTP layer (``app.errors``) turns them into JSON answers; the CLI prints them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from engine.contract.spec import FIELD_MESSAGE, SPEC_CLASSES, error_message


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, field: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.headers = headers  # sent with the answer, e.g. Retry-After of a 429


def team_limit_reached(code: str, message: str, retry_after_s: int) -> ApiError:
    """429 for a team at one of its limits: the count frees itself in time, so the client is told when to retry."""
    return ApiError(429, code, message, None, headers={"Retry-After": str(retry_after_s)})


def error_body(code: str, message: str, field: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"code": code, "message": message, "field": field, **extra}


def _bare(message: str) -> str:
    """pydantic's "Value error, " / "Assertion failed, " prefixes say nothing to a user."""
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message


def _loc_to_field(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    if parts and parts[0] in SPEC_CLASSES:  # the discriminated union adds the kind as the first element
        parts = parts[1:]
    return ".".join(parts) or None


def validation_errors(errors: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """pydantic errors -> ``[{code, message, field}]``. A model validator's "field: message" names its field."""
    out = []
    for err in errors:
        field, message = _loc_to_field(tuple(err.get("loc", ()))), error_message(err)
        match = FIELD_MESSAGE.match(message)
        if match:
            named = match.group(1)
            field = f"{field}.{named}" if field and not named.startswith(field) else named
            message = f"{named}: {match.group(2)}"
        elif field:
            message = f"{field}: {_bare(message)}"
        else:
            message = _bare(message)
        out.append(error_body(err.get("type", "invalid"), message, field))
    return out
