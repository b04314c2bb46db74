"""/docs (Swagger UI) and /redoc served from files on this host: the ``fastapi-offline`` package's copies of
swagger-ui and ReDoc, and a start-up script of ours, so that no page runs a CDN's script or an inline one (the CSP
of ``app.security_headers`` forbids both). FastAPI's own pages would do both."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import fastapi_offline
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from app.schemas import ErrorBody

ASSETS = Path(fastapi_offline.__file__).parent / "static"

_SWAGGER = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title} - API docs</title>
<link rel="stylesheet" href="/docs-assets/swagger-ui.css"><link rel="icon" href="/docs-assets/favicon.png"></head>
<body><div id="swagger-ui" data-openapi-url="{openapi}"></div>
<script src="/docs-assets/swagger-ui-bundle.js"></script><script src="/ui/docs/swagger-init.js"></script>
</body></html>"""

_REDOC = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title} - ReDoc</title>
<link rel="icon" href="/docs-assets/favicon.png"></head>
<body><redoc spec-url="{openapi}"></redoc><script src="/docs-assets/redoc.standalone.js"></script></body></html>"""


REDOC_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"


@functools.cache
def _redoc_bundle() -> bytes:
    """ReDoc's bundle without the one URL it loads from elsewhere: the sidebar's "API docs by Redocly" logo (an
    ``<img>`` from cdn.redoc.ly, which the CSP refuses). An empty ``src`` fails at once, and ReDoc then drops the
    image (its own ``onError``), leaving the text link."""
    return (ASSETS / "redoc.standalone.js").read_bytes().replace(REDOC_LOGO, b"")


def install_docs(app: FastAPI) -> None:
    """Add /docs, /redoc and /docs-assets; create the app with ``docs_url=None, redoc_url=None``."""
    openapi = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return HTMLResponse(_SWAGGER.format(title=app.title, openapi=openapi))

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return HTMLResponse(_REDOC.format(title=app.title, openapi=openapi))

    @app.get("/docs-assets/redoc.standalone.js", include_in_schema=False)
    def redoc_bundle() -> Response:  # matched before the mount below
        return Response(_redoc_bundle(), media_type="text/javascript", headers={"Cache-Control": "max-age=3600"})

    app.mount("/docs-assets", StaticFiles(directory=ASSETS), name="docs-assets")


def document_refusals(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document as clients must read it: ``kind`` is required in every job spec (it selects the spec,
    the server has no default), and every operation may answer 400 (``app.input_guard`` refuses hostile input on any
    route before it runs)."""
    components = schema.get("components", {}).get("schemas", {})
    for ref in components.get("JobSpec", {}).get("discriminator", {}).get("mapping", {}).values():
        spec = components.get(ref.rsplit("/", 1)[-1], {})
        if "kind" in spec.get("properties", {}) and "kind" not in spec.setdefault("required", []):
            spec["required"].insert(0, "kind")
    components["ErrorBody"] = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(components["ErrorBody"].pop("$defs", {}))
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's {detail: [...]}: never what we answer
        components.pop(name, None)
    components["OpenAIErrorBody"] = OPENAI_ERROR
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    # The OpenAI-compatible routes answer their own errors in OpenAI's shape; the edge (input guard, body limits)
    # answers before a route runs, in the API's.
    either = {"application/json": {"schema": {"anyOf": [{"$ref": "#/components/schemas/OpenAIErrorBody"},
                                                        {"$ref": "#/components/schemas/ErrorBody"}]}}}  # fmt: skip
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            if isinstance(operation, dict) and "responses" in operation:
                responses = operation["responses"]
                responses.setdefault("400", {"description": BAD_REQUEST})
                if path.startswith("/v1/"):
                    responses.setdefault("401", {"description": "No token, or a revoked or unknown one"})
                for code, response in responses.items():
                    if code[0] in "45":
                        response["content"] = either if "openai" in operation.get("tags", ()) else error
                        if code == "422":
                            response["description"] = "Validation error; field names the offending field"
    _document_metadata_filter(schema)
    return schema


def _document_metadata_filter(schema: dict[str, Any]) -> None:
    """``metadata[key]=value`` filters of GET /v1/jobs (read from the raw query string, so FastAPI cannot see them)."""
    operation = schema.get("paths", {}).get("/v1/jobs", {}).get("get")
    if operation is not None:
        operation.setdefault("parameters", []).append(
            {
                "name": "metadata",
                "in": "query",
                "required": False,
                "style": "deepObject",
                "explode": True,
                "schema": {"type": "object", "additionalProperties": {"type": "string"}},
                "description": "metadata[key]=value: only jobs whose metadata has key equal to value (several: all)",
            }
        )


OPENAI_ERROR: dict[str, Any] = {
    "title": "OpenAIErrorBody",
    "description": "An error of the OpenAI-compatible routes, in OpenAI's shape (app.openai_format.OpenAIError).",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

BAD_REQUEST = (
    "Refused input: a body that is not JSON or holds NaN, out-of-range numbers or nesting beyond 64 "
    "levels; a NUL in the path or query"
)
