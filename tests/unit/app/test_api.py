"""The HTTP API on SQLite, in-process: auth, teams, idempotency, validation errors, 413, lists, feeds, SSE resume."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert

from core.db import session_scope
from core.jobs import transition
from core.models import ApiToken, Event, LogLine, MetricPoint
from core.settings import Settings
from core.states import JobState
from core_support import auth, isolated_settings, make_token, team_dir


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = isolated_settings(tmp_path, max_body_bytes=4096)
    for team in ("alpha", "beta", "ops"):
        data = team_dir(settings, team)
        (data / "in.jsonl").write_text('{"text": "hi"}\n')
        (data / "tok").mkdir()
    return settings


def spec(**extra: Any) -> dict[str, Any]:
    return {
        "kind": "preprocess",
        "input": "in.jsonl",
        "tokenizer_name_or_path": "tok",
        "output_prefix": "out/x",
        **extra,
    }


def submit(client: TestClient, token: str, body: Any, **headers: str) -> Any:
    return client.post("/v1/jobs", json=body, headers={**auth(token), **headers})


def test_health_needs_no_token(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/readyz").json() == {"status": "ok", "checks": {"database": "ok"}}


def test_no_token_is_401_everywhere(client: TestClient) -> None:
    for method, path in [
        ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs/x"),
        ("GET", "/v1/jobs/x/stream"),
    ]:
        response = client.request(method, path)
        assert response.status_code == 401, path
        assert response.json()["code"] == "unauthorized"
    assert client.get("/v1/jobs", headers=auth("llmj_wrong")).status_code == 401


def test_submit_resolves_paths_and_queues(client: TestClient, token: str, settings: Settings) -> None:
    response = submit(client, token, spec(name="n1", metadata={"team_run": "a"}))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["state"] == "queued" and job["kind"] == "preprocess" and job["team"] == "alpha"
    assert job["spec"]["input"] == str(team_dir(settings, "alpha") / "in.jsonl")
    assert job["run_dir"] == str(settings.runs_path / job["id"])
    assert job["pending_reason"]


def test_other_team_sees_404(client: TestClient, token: str, settings: Settings) -> None:
    job_id = submit(client, token, spec()).json()["id"]
    other = make_token(settings, "beta")
    for path in ["", "/events", "/metrics", "/logs", "/artifacts", "/stream"]:
        assert client.get(f"/v1/jobs/{job_id}{path}", headers=auth(other)).status_code == 404, path
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(other)).status_code == 404
    assert client.get("/v1/jobs", headers=auth(other)).json()["data"] == []
    admin = make_token(settings, "ops", admin=True)
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(admin)).status_code == 200


def test_revoked_tokens_are_refused_at_once(client: TestClient, token: str, settings: Settings) -> None:
    from core.auth import list_tokens, revoke_token

    job_id = submit(client, token, spec()).json()["id"]
    second = make_token(settings, "alpha")
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(second)).status_code == 200
    with session_scope(settings.database_url) as session:
        assert revoke_token(session, "llmj_") == 0  # not a name of any token
        session.add(ApiToken(token_hash="0" * 64, prefix=second[:12], team="beta"))  # a (one in 2^42) prefix clash
        session.flush()
        with pytest.raises(ValueError, match="matches 2 tokens; give the token id"):
            revoke_token(session, second[:12])
        session.rollback()
    with session_scope(settings.database_url) as session:
        assert revoke_token(session, second[:12]) == 1  # the prefix `token list` prints
    response = client.get(f"/v1/jobs/{job_id}", headers=auth(second))
    assert response.status_code == 401 and response.json()["message"] == "invalid or revoked token"
    assert (
        client.get(f"/v1/jobs/{job_id}", headers=auth(token)).status_code == 200
    )  # the team's other token still works
    with session_scope(settings.database_url) as session:
        rows = {t.prefix: t for t in list_tokens(session, "alpha")}
        assert rows[second[:12]].revoked_at is not None and rows[token[:12]].revoked_at is None
        assert revoke_token(session, str(rows[second[:12]].id)) == 0  # already revoked: nothing to do
        assert revoke_token(session, token) == 1  # the token itself
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(token)).status_code == 401


def test_idempotency_replay_and_conflict(client: TestClient, token: str) -> None:
    first = submit(client, token, spec(), **{"Idempotency-Key": "k1"})
    again = submit(client, token, spec(), **{"Idempotency-Key": "k1"})
    assert first.status_code == again.status_code == 201
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    conflict = submit(client, token, spec(name="other"), **{"Idempotency-Key": "k1"})
    assert conflict.status_code == 409
    assert conflict.json()["code"] == "idempotency_conflict"
    assert len(client.get("/v1/jobs", headers=auth(token)).json()["data"]) == 1


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        (spec(input="../etc/passwd"), "input", "'..'"),
        (spec(input="/etc/passwd"), "input", "outside your data area"),
        (spec(bogus=1), "bogus", "unknown field"),
        (spec(workers=0), "workers", "greater than or equal to 1"),
        (spec(resources={"nproc_per_node": 0}), "resources.nproc_per_node", "greater than or equal to 1"),
        (
            {
                "kind": "train",
                "data_path": "d",
                "train_iters": 1,
                "lr": 0.1,
                "global_batch_size": 3,
                "micro_batch_size": 2,
            },
            "global_batch_size",
            "not divisible by micro_batch_size",
        ),
        ({"kind": "nope"}, "kind", "preprocess, convert, train, eval, serve, pipeline"),
        ({"kind": "train", "data_path": "0.5 ok 0.5 ../../etc/x", "train_iters": 1, "lr": 0.1}, "data_path", "'..'"),
        (
            {"kind": "train", "data_path": "d", "train_iters": 1, "lr": 0.1, "lora_target_modules": "linear_qkvv"},
            "lora_target_modules",
            "unknown ['linear_qkvv']",
        ),
        (
            {"kind": "eval", "load": "m", "eval_data_path": "t.jsonl", "lora_target_modules": ["q_proj", "v_proj"]},
            "lora_target_modules",
            "only part of the fused linear_qkv",
        ),
    ],
)
def test_validation_errors_name_the_field(
    client: TestClient, token: str, body: Any, field: str | None, text: str
) -> None:
    response = submit(client, token, body)
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["code"] == "validation_error"
    assert error["field"] == field
    assert text in error["message"]
    assert error["errors"][0]["field"] == field


def test_symlink_escape_is_refused(client: TestClient, token: str, settings: Settings, tmp_path: Path) -> None:
    outside = tmp_path / "secret.jsonl"
    outside.write_text("{}\n")
    (team_dir(settings, "alpha") / "link.jsonl").symlink_to(outside)
    response = submit(client, token, spec(input="link.jsonl"))
    assert response.status_code == 422
    assert response.json()["field"] == "input"


def test_malformed_json_and_big_body(client: TestClient, token: str) -> None:
    bad = client.post("/v1/jobs", content=b"{not json", headers={**auth(token), "Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_json"
    big = submit(client, token, spec(name="x" * 5000))
    assert big.status_code == 413
    assert big.json()["code"] == "payload_too_large"
    chunked = client.post("/v1/jobs", content=iter([b"{" + b" " * 3000, b" " * 3000 + b"}"]), headers=auth(token))
    assert chunked.status_code == 413


def test_list_pages_and_filters(client: TestClient, token: str, settings: Settings) -> None:
    ids = [
        submit(client, token, spec(name=f"j{i}", metadata={"exp": "a" if i % 2 else "b"})).json()["id"]
        for i in range(5)
    ]
    page = client.get("/v1/jobs", params={"limit": 2}, headers=auth(token)).json()
    assert [j["id"] for j in page["data"]] == ids[::-1][:2] and page["has_more"]
    page2 = client.get("/v1/jobs", params={"limit": 2, "after": page["last_id"]}, headers=auth(token)).json()
    assert [j["id"] for j in page2["data"]] == ids[::-1][2:4]
    by_meta = client.get("/v1/jobs", params={"metadata[exp]": "a"}, headers=auth(token)).json()["data"]
    assert sorted(j["id"] for j in by_meta) == sorted([ids[1], ids[3]])
    assert [j["name"] for j in client.get("/v1/jobs", params={"name": "j2"}, headers=auth(token)).json()["data"]] == [
        "j2"
    ]
    assert client.get("/v1/jobs", params={"state": "running"}, headers=auth(token)).json()["data"] == []
    assert client.get("/v1/jobs", params={"after": "missing"}, headers=auth(token)).json()["field"] == "after"


def test_cancel_queued_job_is_immediate_and_final(client: TestClient, token: str) -> None:
    job_id = submit(client, token, spec()).json()["id"]
    response = client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(token))
    assert response.status_code == 202 and response.json()["state"] == "cancelled"
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(token)).json()["state"] == "cancelled"
    events = client.get(f"/v1/jobs/{job_id}/events", headers=auth(token)).json()["data"]
    assert [e["data"]["state"] for e in events] == ["queued", "cancelled"]


def _record_run(settings: Settings, job_id: str) -> None:
    """What a worker would have written for a finished job."""
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, JobState.starting)
        assert transition(session, job_id, JobState.running)
        session.execute(
            insert(MetricPoint),
            [
                {"job_id": job_id, "step": s, "name": n, "value": v, "rank": r}
                for s in (1, 2, 3)
                for n, v, r in (("lm_loss", 2.0 / s, None), ("mem_allocated_mb", 10.0, 0))
            ],
        )
        session.execute(
            insert(LogLine),
            [
                {"job_id": job_id, "stream": st, "seq": i, "text": f"{st} {i}"}
                for st in ("launcher", "rank0")
                for i in range(3)
            ],
        )
        session.execute(insert(Event), [{"job_id": job_id, "type": "progress", "message": "1/1", "data": {}}])
        session.commit()
        assert transition(
            session, job_id, JobState.succeeded, result={"kind": "preprocess", "outputs": {}, "summary": {}}
        )


def test_feeds_metrics_logs_and_sse_resume(client: TestClient, token: str, settings: Settings) -> None:
    job_id = submit(client, token, spec()).json()["id"]
    _record_run(settings, job_id)
    metrics = client.get(
        f"/v1/jobs/{job_id}/metrics", params={"names": "lm_loss", "since_step": 1}, headers=auth(token)
    ).json()
    assert [(p["step"], p["value"]) for p in metrics["data"]] == [(2, 1.0), (3, 2.0 / 3)]
    paged = client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 3}, headers=auth(token)).json()
    assert {p["step"] for p in paged["data"]} == {1} and paged["has_more"] and paged["next_since_step"] == 1
    logs = client.get(f"/v1/jobs/{job_id}/logs", params={"rank": 0, "offset": 1}, headers=auth(token)).json()
    assert [line["text"] for line in logs["data"]] == ["rank0 1", "rank0 2"] and logs["next_offset"] == 3
    assert client.get(f"/v1/jobs/{job_id}/logs", headers=auth(token)).json()["data"][0]["text"] == "launcher 0"

    messages = _sse(client, job_id, token)
    kinds = [m["event"] for m in messages]
    assert kinds[-1] == "end" and "id" not in messages[-1]  # the final state's id is not repeated on end
    ids = [m["id"] for m in messages[:-1]]
    assert len(set(ids)) == len(ids)
    assert kinds.count("metric") == 6 and kinds.count("log") == 6 and kinds.count("state") == 4
    # Resume after the 5th message: exactly the rest arrives again.
    resumed = _sse(client, job_id, token, last_event_id=messages[4]["id"])
    assert [m["data"] for m in resumed] == [m["data"] for m in messages[5:]]
    assert client.get(f"/v1/jobs/{job_id}/stream", headers={**auth(token), "Last-Event-ID": "x"}).status_code == 400


def _sse(client: TestClient, job_id: str, token: str, last_event_id: str | None = None) -> list[dict[str, Any]]:
    headers = {**auth(token), **({"Last-Event-ID": last_event_id} if last_event_id else {})}
    messages, current = [], {}
    with client.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                if current:
                    messages.append(current)
                current = {}
            elif line.startswith(("event:", "id:", "data:")):
                key, _, value = line.partition(":")
                current[key] = json.loads(value) if key == "data" else value.strip()
    return messages


def test_openapi_has_every_kind(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert {"PreprocessSpec", "TrainSpec", "ConvertSpec", "EvalSpec", "PipelineSpec"} <= set(schemas)
    assert "global_batch_size" in schemas["TrainSpec"]["properties"]


def test_stream_interleaves_feeds_by_time(client: TestClient, token: str, settings: Settings) -> None:
    job_id = submit(client, token, spec()).json()["id"]
    base = datetime(2030, 1, 1, tzinfo=timezone.utc)
    with session_scope(settings.database_url) as session:
        assert transition(session, job_id, JobState.cancelled)
        session.execute(
            insert(Event),
            [
                {"job_id": job_id, "type": "warning", "message": m, "data": {}, "time": base + timedelta(seconds=s)}
                for m, s in (("first", 1), ("third", 3))
            ],
        )
        session.execute(
            insert(LogLine),
            [{"job_id": job_id, "stream": "launcher", "seq": 0, "text": "second", "time": base + timedelta(seconds=2)}],
        )
        session.execute(
            insert(MetricPoint),
            [{"job_id": job_id, "step": 1, "name": "lm_loss", "value": 1.0, "time": base + timedelta(seconds=4)}],
        )
    messages = [m for m in _sse(client, job_id, token) if m["event"] in ("event", "log", "metric")]
    assert [m["data"].get("message") or m["data"].get("text") or m["event"] for m in messages] == [
        "first",
        "second",
        "third",
        "metric",
    ]
