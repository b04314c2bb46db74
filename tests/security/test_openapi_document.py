"""Finding 8: the OpenAPI document says what the server enforces: ``kind`` is required in every job spec, and every
operation declares the 400 the input guard may answer."""

from __future__ import annotations

from fastapi.testclient import TestClient

from core.settings import Settings


def test_kind_is_required_in_every_job_spec(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    mapping = schemas["JobSpec"]["discriminator"]["mapping"]
    assert set(mapping) == {"preprocess", "convert", "train", "eval", "serve", "pipeline"}
    for ref in mapping.values():
        assert "kind" in schemas[ref.rsplit("/", 1)[-1]]["required"], ref


def test_every_operation_declares_400(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    missing = [
        f"{method.upper()} {path}"
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
        if "400" not in op["responses"]
    ]
    assert missing == []


def test_a_spec_without_kind_is_refused(client: TestClient, settings: Settings) -> None:
    from core_support import auth, make_token

    answer = client.post(
        "/v1/jobs",
        json={"input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o"},
        headers=auth(make_token(settings, "alpha")),
    )
    assert answer.status_code == 422 and "kind" in answer.json()["message"]
