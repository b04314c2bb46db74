"""Every error the API returns is JSON ``{"code", "message", "field"}`` (plus ``errors`` for validation)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import ApiError, error_body, validation_errors

log = logging.getLogger(__name__)
_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    416: "range_not_satisfiable",
    422: "validation_error",
}


def validation_response(errors: Iterable[Mapping[str, Any]], status: int = 422) -> JSONResponse:
    items = validation_errors(errors)
    first = items[0] if items else error_body("invalid", "invalid request")
    return JSONResponse(
        error_body("validation_error", first["message"], first["field"], errors=items), status_code=status
    )


def database_unavailable() -> JSONResponse:
    """The database is down, restarting or unreachable: a retryable 503, not a 500 (the pool reconnects by itself)."""
    return JSONResponse(
        error_body("database_unavailable", "the database is not answering; retry shortly"),
        status_code=503,
        headers={"Retry-After": "5"},
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        body = error_body(exc.code, exc.message, exc.field)
        if exc.status == 422:  # every 422 has the same shape, with the one error as its list
            body["errors"] = [error_body(exc.code, exc.message, exc.field)]
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(list(exc.errors()))

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(_: Request, exc: ValidationError) -> JSONResponse:
        return validation_response(list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "error")
        return JSONResponse(
            error_body(code, str(exc.detail)), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    async def _database_away(request: Request, exc: DBAPIError) -> JSONResponse:
        log.warning("%s %s: database unavailable: %s", request.method, request.url.path, type(exc.orig).__name__)
        return database_unavailable()

    @app.exception_handler(PoolTimeout)
    async def _pool_exhausted(request: Request, exc: PoolTimeout) -> JSONResponse:
        # Every pooled connection stayed busy for pool_timeout: a retryable 503, not a 500.
        log.warning("%s %s: no database connection free: %s", request.method, request.url.path, exc)
        return JSONResponse(
            error_body("database_busy", "no database connection came free in time; retry shortly"),
            status_code=503,
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # The details (SQL, paths) go to the server log, not to the client.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(
            error_body("internal_error", f"internal error ({type(exc).__name__}); see the server log"), status_code=500
        )
