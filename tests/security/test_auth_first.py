"""Issue 39 finding 5: every operation checks its caller before anything reads the body.

The walk covers every operation of /openapi.json, with no token, malformed headers, an unknown and a revoked token,
each with a body of ``{}`` (raw bytes on uploads), called as a bare ASGI app so the test sees whether the body was
read at all. Before the fix, ``POST /v1/chat/completions`` answered 400 (it parsed ``{}`` first).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
from fastapi import FastAPI
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.testclient import TestClient
from starlette.requests import Request

from app.api.deps import get_principal
from app.main import create_app
from core.auth import Principal, revoke_token
from core.db import get_sessionmaker, session_scope
from core.errors import ApiError
from core.settings import Settings
from core_support import auth, make_job, make_token

# Operations a caller without a token may use, and why.
PUBLIC_OPERATIONS = {
    ("GET", "/healthz"): "liveness probe: load balancers and orchestrators call it without a token",
    ("GET", "/readyz"): "readiness probe: same callers; it says only whether the database and broker answer",
}
# Routes left out of the OpenAPI document: the document itself, its viewers and the dashboard's static files.
UNDOCUMENTED_PUBLIC = ["/openapi.json", "/docs", "/redoc", "/docs-assets/redoc.standalone.js", "/", "/ui/style.css"]
MALFORMED = ["Basic YWxwaGE6cHc=", "Bearer", "Bearer ", "bearer", "Token llmj_x", "llmj_abc"]


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    reads: int = 0
    sent: list[dict[str, Any]] = field(default_factory=list)

    def json(self) -> Any:
        return json.loads(self.body)


def call(app: FastAPI, method: str, path: str, headers: dict[str, str], body: bytes) -> Answer:
    """One request straight into the ASGI app, counting how often it asked for the body."""
    answer = Answer(0, {}, b"")

    async def receive() -> dict[str, Any]:
        answer.reads += 1
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")

    sent_headers = [(k.lower().encode(), v.encode("latin-1")) for k, v in headers.items()]
    sent_headers.append((b"content-length", str(len(body)).encode()))
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": sent_headers,
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
        "state": {},
    }
    anyio.run(app, scope, receive, send)
    return answer


def _operations(doc: dict[str, Any], values: dict[str, str]) -> list[tuple[str, str, dict[str, Any]]]:
    out: list[tuple[str, str, dict[str, Any]]] = []
    for template, operations in doc["paths"].items():
        path = template.format(**values)
        out.extend((method.upper(), path, op) for method, op in operations.items())
    return out


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings, reconcile=False)


@pytest.fixture
def bad_headers(settings: Settings) -> list[dict[str, str]]:
    revoked = make_token(settings, "alpha")
    with session_scope(settings.database_url) as session:
        assert revoke_token(session, revoked) == 1
    unknown = "llmj_" + uuid.uuid4().hex
    return [{}, *({"Authorization": m} for m in MALFORMED), auth(unknown), auth(revoked)]


def test_every_operation_answers_401_before_reading_the_body(
    app: FastAPI, settings: Settings, bad_headers: list[dict[str, str]]
) -> None:
    doc = TestClient(app).get("/openapi.json").json()
    values = {
        "job_id": make_job(settings, team="alpha"),
        "webhook_id": str(uuid.uuid4()),
        "name": "log",
        "team": "alpha",
    }
    values["path"] = "in.jsonl"
    operations = _operations(doc, values)
    assert len(operations) >= 25 and ("POST", "/v1/chat/completions") in {(m, p) for m, p, _ in operations}
    failures, checked = [], 0
    for method, path, op in operations:
        if (method, path) in PUBLIC_OPERATIONS:
            assert not op.get("security"), f"{method} {path} is public but documents a security requirement"
            continue
        assert op.get("security"), f"{method} {path} documents no security requirement"
        body = b"\x00raw file bytes" if path.startswith("/v1/files/") and method == "PUT" else b"{}"
        for headers in bad_headers:
            answer = call(app, method, path, {"content-type": "application/json", **headers}, body)
            checked += 1
            challenge = answer.headers.get("www-authenticate")
            if answer.status != 401 or answer.reads or challenge != "Bearer":
                failures.append(
                    f"{method} {path} {headers or 'no header'}: {answer.status}, read {answer.reads}x, {challenge=}"
                )
                continue
            _assert_401_shape(answer.json(), openai="openai" in op.get("tags", ()))
    assert not failures, "\n".join(failures)
    assert checked == (len(operations) - len(PUBLIC_OPERATIONS)) * len(bad_headers)


def _assert_401_shape(body: dict[str, Any], openai: bool) -> None:
    if openai:
        assert body["error"]["type"] == "authentication_error" and body["error"]["message"], body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    else:
        assert body["code"] == "unauthorized" and body["field"] == "Authorization" and body["message"], body


def test_public_routes_need_no_token(app: FastAPI) -> None:
    with TestClient(app) as client:
        for method, path in PUBLIC_OPERATIONS:
            assert client.request(method, path).status_code in (200, 503), path
        for path in UNDOCUMENTED_PUBLIC:
            assert client.get(path).status_code == 200, path


def test_a_valid_token_still_reaches_the_route(app: FastAPI, settings: Settings) -> None:
    token = make_token(settings, "alpha")
    answer = call(app, "POST", "/v1/chat/completions", {"content-type": "application/json", **auth(token)}, b"{}")
    assert answer.status == 400 and answer.json()["error"]["param"] == "model"  # now the body is read and judged
    assert answer.reads >= 1


def test_unknown_paths_stay_404_and_wrong_methods_405_with_allow(app: FastAPI) -> None:
    assert call(app, "POST", "/v1/nothing-here", {}, b"{}").status == 404
    for path, allowed in [("/v1/jobs/x", "DELETE, GET"), ("/v1/webhooks", "GET, POST"), ("/v1/files/a", "DELETE, PUT")]:
        answer = call(app, "OPTIONS", path, {}, b"")
        assert (answer.status, answer.headers["allow"]) == (405, allowed), path
        assert answer.reads == 0


def test_get_principal_reuses_the_middlewares_lookup() -> None:
    principal = Principal(team="alpha", admin=False, token_id=7)
    request = Request({"type": "http", "headers": [], "state": {"principal": principal}})
    # No session and no credentials: a second lookup would fail.
    assert get_principal(request, session=None, credentials=None) is principal  # type: ignore[arg-type]


def test_routes_called_without_the_middleware_still_authenticate(settings: Settings) -> None:
    request = Request({"type": "http", "headers": [], "state": {}})
    token = make_token(settings, "alpha")
    with get_sessionmaker(settings.database_url)() as session:
        with pytest.raises(ApiError, match="missing bearer token"):
            get_principal(request, session=session, credentials=None)
        bearer = HTTPAuthorizationCredentials(scheme="Bearer", credentials=token)
        assert get_principal(request, session=session, credentials=bearer).team == "alpha"
