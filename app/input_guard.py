"""Hostile request input refused at the edge, before any route runs or anything is stored.

Python's ``json`` accepts what the rest of the service cannot take: lone surrogates (no UTF-8 form, so SQLite,
PostgreSQL and the JSON encoder fail on them), NUL characters (PostgreSQL text refuses them), ``NaN``/``1e309``
(no JSON form on the way out), 10,000-deep nesting (``RecursionError``), integers of over 4,300 digits
(``ValueError``) or beyond the 64-bit columns. ``InputGuardMiddleware`` parses every JSON request body once with
those refused (400 ``invalid_json``) and walks it without recursion for bad strings (422 naming the field); the path
and query string are checked for NUL (400 naming the parameter). ``check_metadata`` holds job labels to the sizes an
admin sets. A pure ASGI middleware (not a route dependency) so that every route, present and future, is covered.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes

from starlette.types import Message, Receive, Scope, Send

from app.errors import ApiError, error_body
from app.http_middleware import HttpMiddleware
from app.limits import is_upload
from core.settings import Settings

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_DEPTH = 64
_BODY_METHODS = {"POST", "PUT", "PATCH"}


class Refused(ApiError):
    pass


def _refuse_int(text: str) -> int:
    if len(text.lstrip("-")) > 19 or not -INT64_MAX - 1 <= int(text) <= INT64_MAX:
        raise Refused(400, "invalid_json", f"the body holds an integer beyond 64 bits ({text[:20]}...)")
    return int(text)


def _refuse_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise Refused(400, "invalid_json", f"the body holds a number out of range ({text[:40]})")
    return value


def _refuse_constant(name: str) -> None:
    raise Refused(400, "invalid_json", f"the body holds {name}, which is not JSON")


def bad_string(value: str) -> str | None:
    """Why ``value`` cannot be stored (NUL, lone surrogate), or None."""
    if "\x00" in value:
        return "contains a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate (not valid Unicode text)"
    return None


def _check_tree(obj: Any) -> None:
    """Depth and string checks over a parsed body, iteratively (the body may be as deep as json allowed)."""
    stack: list[tuple[Any, str, int]] = [(obj, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise Refused(400, "invalid_json", f"the body is nested more than {MAX_DEPTH} deep", where or None)
        if isinstance(value, str):
            why = bad_string(value)
            if why:
                raise Refused(422, "validation_error", f"{where or 'body'}: {why}", where or None)
        elif isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{key}" if where else str(key)
                why = bad_string(key)
                if why:
                    raise Refused(422, "validation_error", f"{where or 'body'}: a key {why}", where or None)
                stack.append((item, path, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}.{i}" if where else str(i), depth + 1) for i, item in enumerate(value))


def check_json_body(raw: bytes) -> None:
    """Raise ``Refused`` for a JSON body the service must not take; a body that is not JSON at all passes
    (the route answers it as it always did)."""
    try:
        parsed = json.loads(raw, parse_int=_refuse_int, parse_float=_refuse_float, parse_constant=_refuse_constant)
    except RecursionError:
        raise Refused(400, "invalid_json", f"the body is nested more than {MAX_DEPTH} deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return
    except ValueError as err:  # int() of a number too long to convert, from within parse_int
        raise Refused(400, "invalid_json", f"the body holds a number out of range ({err})") from err
    _check_tree(parsed)


def check_url_parts(scope: Scope) -> None:
    """NUL in the path or in a query parameter: 400 naming it (PostgreSQL cannot even compare such text). Percent
    escapes that are not UTF-8 (``%FF``): 400 too, where the server would otherwise put U+FFFD in their place (an
    upload stored under a name its sender never gave)."""
    if "\x00" in scope.get("path", ""):
        raise Refused(400, "bad_request", "the path contains a NUL character", "path")
    try:
        unquote_to_bytes(scope.get("raw_path") or b"").decode("utf-8")
    except UnicodeDecodeError as err:
        raise Refused(400, "bad_request", f"path: percent-escapes that are not UTF-8 ({err.reason})", "path") from None
    query = scope.get("query_string", b"").decode("latin-1")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, errors="strict")
    except UnicodeDecodeError as err:
        raise Refused(400, "bad_request", f"query: percent-escapes that are not UTF-8 ({err.reason})", None) from None
    for key, value in pairs:
        if "\x00" in key or "\x00" in value:
            raise Refused(
                400, "bad_request", f"{key.replace(chr(0), '')}: contains a NUL character", key.replace("\x00", "")
            )


def _metadata_of(raw: Any) -> list[tuple[str, Any]]:
    """The ``metadata`` objects of a submitted spec: the job's own and each pipeline step's."""
    found = [("metadata", raw.get("metadata"))] if isinstance(raw, dict) else []
    steps = raw.get("steps") if isinstance(raw, dict) else None
    for i, step in enumerate(steps if isinstance(steps, list) else []):
        spec = step.get("spec") if isinstance(step, dict) else None
        if isinstance(spec, dict):
            found.append((f"steps.{i}.spec.metadata", spec.get("metadata")))
    return [(where, meta) for where, meta in found if isinstance(meta, dict)]


def check_metadata(raw: Any, settings: Settings) -> None:
    """Job labels within the admin's limits (keys, key and value length, total size): 422 naming the field."""
    for where, meta in _metadata_of(raw):
        if len(meta) > settings.metadata_max_keys:
            raise ApiError(422, "validation_error", f"{where}: at most {settings.metadata_max_keys} keys", where)
        total = 0
        for key, value in meta.items():
            if len(key) > settings.metadata_max_key_length:
                raise ApiError(
                    422,
                    "validation_error",
                    f"{where}: key {key[:40]!r}... is longer than {settings.metadata_max_key_length} characters",
                    where,
                )
            if isinstance(value, str) and len(value) > settings.metadata_max_value_length:
                raise ApiError(
                    422,
                    "validation_error",
                    f"{where}.{key}: longer than {settings.metadata_max_value_length} characters",
                    f"{where}.{key}",
                )
            total += len(key.encode()) + len(str(value).encode())
        if total > settings.metadata_max_bytes:
            raise ApiError(
                422,
                "validation_error",
                f"{where}: {total} bytes of keys and values, more than {settings.metadata_max_bytes}",
                where,
            )


class InputGuardMiddleware(HttpMiddleware):
    """Runs ``check_url_parts`` and (for bodies) ``check_json_body`` before the app; answers refusals itself."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            check_url_parts(scope)
            if scope.get("method") not in _BODY_METHODS or is_upload(scope):  # an upload is a file, not JSON
                await self.app(scope, receive, send)
                return
            body, more = b"", True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    break
                body += message.get("body", b"")
                more = message.get("more_body", False)
            if body.strip():
                check_json_body(body)
        except Refused as err:
            await _answer(send, err)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _answer(send: Send, err: ApiError) -> None:
    raw = json.dumps(error_body(err.code, err.message, err.field)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": raw})
