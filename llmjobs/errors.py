"""The SDK's exceptions: one class per kind of API refusal, each carrying the API's ``{code, message, field}``.

Every error answer of the service is JSON ``{"code", "message", "field", "errors"}``; ``raise_for`` turns it into
``NotFound``, ``Conflict``, ``ValidationError`` ... so callers catch what they can handle and read ``field``.
"""

from __future__ import annotations

from typing import Any

import httpx

TOKEN_HINT = " — set LLMJOBS_TOKEN to a valid API token (an admin makes one with `llmjobs token create --team T`)"


class LlmjobsError(Exception):
    """An error answer of the API (``status``, ``code``, ``message``, ``field``, ``errors``), or no answer at all."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        code: str | None = None,
        field: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        text: str | None = None,
    ):
        super().__init__(text or message)
        self.message, self.status, self.code, self.field, self.errors = message, status, code, field, errors or []


class ApiConnectionError(LlmjobsError):
    """The server could not be reached, or the connection broke."""


class BadRequest(LlmjobsError):
    """400: malformed input (not JSON, a bad cursor, a NUL in the URL)."""


class Unauthorized(LlmjobsError):
    """401: no token, or an unknown or revoked one."""


class Forbidden(LlmjobsError):
    """403: the token may not do this (an admin-only call)."""


class NotFound(LlmjobsError):
    """404: no such job, artifact or file, or one of another team."""


class Conflict(LlmjobsError):
    """409: the job is in the wrong state, or the file exists."""


class PayloadTooLarge(LlmjobsError):
    """413: the body is over the server's limit."""


class ValidationError(LlmjobsError):
    """422: the request is invalid; ``field`` names the first offending field, ``errors`` lists every one."""


class ServerError(LlmjobsError):
    """5xx: the service failed or is unavailable (503: retry shortly)."""


class WaitTimeout(LlmjobsError, TimeoutError):
    """``wait`` gave up before the job ended; ``job`` is the job as last seen."""

    def __init__(self, message: str, job: dict[str, Any]):
        super().__init__(message)
        self.job = job


_BY_STATUS: dict[int, type[LlmjobsError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: ValidationError,
}


def error_from(response: httpx.Response) -> LlmjobsError:
    """The exception for an error answer whose body has been read."""
    try:
        body = response.json()
        code, message, field, errors = body.get("code"), body.get("message"), body.get("field"), body.get("errors")
    except (ValueError, AttributeError):
        code, message, field, errors = None, response.text, None, None
    status = response.status_code
    text = f"HTTP {status} {code}: {message}" + (f" (field {field})" if field else "")
    if status == 401:
        text += TOKEN_HINT
    kind = _BY_STATUS.get(status, ServerError if status >= 500 else LlmjobsError)
    return kind(str(message), status, code, field, errors, text=text)


def unreachable(url: str, err: Exception) -> ApiConnectionError:
    return ApiConnectionError(f"cannot reach {url}: {err}")
