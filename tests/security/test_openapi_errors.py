"""The OpenAPI document declares every error answer with the schema the API really sends: real 400/401/404/409/413/
422 bodies validate against the operation's declared response schema; metadata[key] is a documented parameter."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from jsonschema import Draft202012Validator

from core.settings import Settings
from tests.core_support import auth, make_token


def _declared(doc: dict[str, Any], path: str, method: str, status: int) -> dict[str, Any]:
    response = doc["paths"][path][method]["responses"][str(status)]
    return {**response["content"]["application/json"]["schema"], "components": doc["components"]}


def test_real_error_bodies_match_the_declared_schemas(client: TestClient, settings: Settings) -> None:
    doc = client.get("/openapi.json").json()
    token = make_token(settings, "alpha")
    spec = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o/x"}
    keyed = {**auth(token), "Idempotency-Key": "k1"}
    finished = client.post("/v1/jobs", json=spec, headers=keyed).json()["id"]
    cases = [
        ("/v1/jobs", "get", 401, lambda: client.get("/v1/jobs")),
        ("/v1/jobs/{job_id}", "get", 404, lambda: client.get("/v1/jobs/nope", headers=auth(token))),
        ("/v1/jobs", "get", 422, lambda: client.get("/v1/jobs?limit=0", headers=auth(token))),
        ("/v1/jobs", "get", 422, lambda: client.get("/v1/jobs?state=runing", headers=auth(token))),
        (
            "/v1/jobs",
            "post",
            422,
            lambda: client.post("/v1/jobs", json={**spec, "learning_rate": 1}, headers=auth(token)),
        ),
        ("/v1/jobs", "post", 400, lambda: client.post("/v1/jobs", content=b"{", headers=auth(token))),
        ("/v1/jobs", "post", 413, lambda: client.post("/v1/jobs", content=b"x" * 2_000_000, headers=auth(token))),
        ("/v1/jobs", "post", 409, lambda: client.post("/v1/jobs", json={**spec, "name": "other"}, headers=keyed)),
        (
            "/v1/jobs/{job_id}/metrics",
            "get",
            400,
            lambda: client.get(f"/v1/jobs/{finished}/metrics?after=x", headers=auth(token)),
        ),
    ]
    for path, method, status, call in cases:
        answer = call()
        assert answer.status_code == status, (path, status, answer.text)
        Draft202012Validator(_declared(doc, path, method, status)).validate(answer.json())
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    names = [p["name"] for p in doc["paths"]["/v1/jobs"]["get"]["parameters"]]
    assert {"state", "kind", "name", "after", "limit", "metadata"} <= set(names)


def test_the_declared_schema_refuses_what_the_api_must_not_send(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    validator = Draft202012Validator(_declared(doc, "/v1/jobs", "post", 422))
    assert not validator.is_valid({"detail": [{"loc": ["body"], "msg": "x", "type": "y"}]})  # FastAPI's shape
