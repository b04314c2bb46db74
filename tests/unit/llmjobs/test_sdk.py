"""The Python SDK (``llmjobs``) against the real app in-process: jobs round trip, auto-paging lists that lose and
repeat nothing, typed errors with code and field, the SSE stream resumed after a dropped connection, reads and
idempotent writes sent again after a 503 (as a proxy or the API with its database away answers), downloads and
uploads, and the async client."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import insert

from app.main import create_app
from core.db import session_scope
from core.jobs import transition
from core.models import Artifact, LogLine, MetricPoint
from core.paths import team_area
from core.settings import Settings
from core.states import JobState
from core_support import auth, isolated_settings, make_job, make_token
from llmjobs import (
    ApiConnectionError,
    AsyncClient,
    Client,
    Conflict,
    NotFound,
    ServerError,
    StreamMessage,
    Unauthorized,
    ValidationError,
    WaitTimeout,
    _common,
)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path / "var")


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings, reconcile=False)


@pytest.fixture
def token(settings: Settings) -> str:
    return make_token(settings, "alpha")


@pytest.fixture
def client(app: FastAPI, token: str) -> Iterator[Client]:
    with TestClient(app, headers=auth(token)) as http:
        yield Client(http=http)


def finished_job(settings: Settings) -> str:
    """A succeeded job with 3 steps x 7 metrics, two log streams and one file artifact."""
    job_id = make_job(settings, team="alpha", name="done")
    output = team_area(settings, "alpha") / "out.bin"  # a job's outputs are in its team's area
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(bytes(range(256)) * 40)
    with session_scope(settings.database_url) as session:
        session.execute(
            insert(MetricPoint),
            [
                {"job_id": job_id, "step": s, "name": f"m{i}", "value": float(s * 10 + i), "rank": None}
                for s in (1, 2, 3)
                for i in range(7)
            ],
        )
        session.execute(
            insert(LogLine),
            [
                {"job_id": job_id, "stream": st, "seq": i, "text": f"{st} {i}"}
                for st in ("launcher", "rank0")
                for i in range(5)
            ],
        )
        session.execute(
            insert(Artifact),
            [{"job_id": job_id, "name": "out", "path": str(output), "files": [], "size_bytes": output.stat().st_size}],
        )
        session.commit()
        for state in (JobState.starting, JobState.running):
            assert transition(session, job_id, state)
        assert transition(
            session, job_id, JobState.succeeded, result={"kind": "preprocess", "outputs": {}, "summary": {}}
        )
    return job_id


def test_jobs_round_trip_with_uploaded_inputs(client: Client, settings: Settings, tmp_path: Path) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text('{"text": "hi"}\n')
    uploaded = client.upload(data, "demo/in.jsonl")
    assert uploaded["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text("{}")
    assert [f["path"] for f in client.upload_dir(tokenizer, "demo/tok")] == ["demo/tok/tokenizer_config.json"]
    assert [f["path"] for f in client.files(prefix="demo", page_size=1)] == [
        "demo/in.jsonl",
        "demo/tok/tokenizer_config.json",
    ]
    tok_dir = str(Path(uploaded["server_path"]).parent / "tok")
    spec = {
        "kind": "preprocess",
        "input": uploaded["server_path"],
        "tokenizer_name_or_path": tok_dir,
        "output_prefix": "out/x",
    }
    ids = [client.create_job({**spec, "name": f"j{i}"})["id"] for i in range(5)]
    replay = client.create_job(json.dumps(spec), idempotency_key="k1")
    assert client.create_job(spec, idempotency_key="k1")["id"] == replay["id"]
    ids.append(replay["id"])
    listed = [j["id"] for j in client.list_jobs(page_size=2)]
    assert listed == ids[::-1]  # newest first, every page followed, none twice
    assert [j["name"] for j in client.list_jobs(name="j3")] == ["j3"]
    assert client.get_job(ids[0])["state"] == "queued"
    assert client.cancel_job(ids[0])["state"] == "cancelled"  # a queued job is cancelled at once
    assert client.wait(ids[0], timeout=5)["state"] == "cancelled"
    with pytest.raises(WaitTimeout) as waited:
        client.wait(ids[1], timeout=0.2, poll_interval=0.1)
    assert waited.value.job["state"] == "queued"
    with pytest.raises(Conflict) as conflict:
        client.delete_job(ids[1])  # still queued
    assert conflict.value.status == 409 and conflict.value.code
    assert client.delete_job(ids[0])["deleted"] is True
    with pytest.raises(NotFound) as missing:
        client.get_job(ids[0])
    assert missing.value.code == "not_found" and missing.value.status == 404


def test_typed_errors_carry_code_and_field(client: Client, app: FastAPI) -> None:
    with pytest.raises(ValidationError) as invalid:
        client.create_job(
            {"kind": "preprocess", "input": "x", "tokenizer_name_or_path": "t", "output_prefix": "o", "train_iterz": 3}
        )
    assert invalid.value.status == 422 and invalid.value.field == "train_iterz" and invalid.value.errors
    with pytest.raises(ValidationError) as kind:
        client.jobs_page(state="runing")
    assert kind.value.field == "state"
    with TestClient(app, headers=auth("llmj_wrong")) as http, pytest.raises(Unauthorized) as denied:
        Client(http=http).get_job("x")
    assert denied.value.code == "unauthorized" and "LLMJOBS_TOKEN" in str(denied.value)
    with pytest.raises(ApiConnectionError):
        Client("http://127.0.0.1:9", token="t").get_job("x")


def test_feeds_page_without_loss(client: Client, settings: Settings, tmp_path: Path) -> None:
    job_id = finished_job(settings)
    points = list(client.metrics(job_id, page_size=5))
    assert [(p["step"], p["name"]) for p in points] == [(s, f"m{i}") for s in (1, 2, 3) for i in range(7)]
    assert [p["step"] for p in client.metrics(job_id, names="m0,m6", page_size=1)] == [1, 1, 2, 2, 3, 3]
    assert [line["text"] for line in client.logs(job_id, rank=0, page_size=2)] == [f"rank0 {i}" for i in range(5)]
    assert [line["text"] for line in client.logs(job_id, page_size=3)] == [f"launcher {i}" for i in range(5)]
    assert [e["message"].split()[-1] for e in client.events(job_id, types="state", page_size=1)][-1] == "succeeded"
    assert [a["name"] for a in client.artifacts(job_id)] == ["out"]
    dest = tmp_path / "out.bin"
    assert client.download(job_id, "out", dest) == 256 * 40
    assert dest.read_bytes() == (team_area(settings, "alpha") / "out.bin").read_bytes()
    with pytest.raises(NotFound):
        client.download(job_id, "nope", tmp_path / "nope.bin")
    assert not (tmp_path / "nope.bin").exists()
    assert client.checkpoints(job_id) == []


class DropOnce(httpx.AsyncBaseTransport):
    """Delegates to the app; the first /stream answer breaks after its first message (a dropped connection)."""

    def __init__(self, inner: httpx.AsyncBaseTransport):
        self.inner, self.dropped, self.resumed_with = inner, False, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("/stream"):
            return response
        self.resumed_with.append(request.headers.get("Last-Event-ID"))
        if self.dropped:
            return response
        self.dropped = True
        first = (await response.aread()).split(b"\r\n\r\n")[0] + b"\r\n\r\n"
        return httpx.Response(response.status_code, headers=response.headers, stream=_Broken(first))


class _Broken(httpx.AsyncByteStream):
    def __init__(self, first: bytes):
        self.first = first

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.first
        raise httpx.ReadError("connection dropped")


def test_stream_resumes_after_a_dropped_connection(
    client: Client, settings: Settings, app: FastAPI, token: str
) -> None:
    job_id = finished_job(settings)
    whole = list(client.stream(job_id))
    assert whole[-1].event == "end" and {m.event for m in whole} >= {"state", "metric", "log"}
    assert list(client.stream(job_id, last_event_id=whole[2].id)) == whole[3:]
    dropping = DropOnce(httpx.ASGITransport(app=app))

    async def follow() -> list[StreamMessage]:
        async with AsyncClient(
            http=httpx.AsyncClient(transport=dropping, base_url="http://test", headers=auth(token))
        ) as flaky:
            return [m async for m in flaky.stream(job_id)]

    assert asyncio.run(follow()) == whole  # nothing lost, nothing repeated
    assert dropping.resumed_with == [None, whole[0].id]


def test_async_client(app: FastAPI, settings: Settings, token: str, tmp_path: Path) -> None:
    job_id = finished_job(settings)
    local = tmp_path / "a.txt"
    local.write_bytes(b"async bytes" * 1000)

    async def scenario() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient(
            http=httpx.AsyncClient(transport=transport, base_url="http://test", headers=auth(token))
        ) as client:
            uploaded = await client.upload(local, "async/a.txt")
            with pytest.raises(Conflict):
                await client.upload(local, "async/a.txt")
            return {
                "sha": uploaded["sha256"],
                "jobs": [j["id"] async for j in client.list_jobs(page_size=1)],
                "job": (await client.wait(job_id))["state"],
                "metrics": len([p async for p in client.metrics(job_id, page_size=4)]),
                "logs": [line["text"] async for line in client.logs(job_id, stream="rank0", page_size=2)],
                "stream": [m.event async for m in client.stream(job_id)][-1],
                "bytes": await client.download(job_id, "out", tmp_path / "out.bin"),
                "files": [f["path"] async for f in client.files()],
            }

    with TestClient(app):  # runs the app's lifespan
        got = asyncio.run(scenario())
    assert got == {
        "sha": hashlib.sha256(local.read_bytes()).hexdigest(),
        "jobs": [job_id],
        "job": "succeeded",
        "metrics": 21,
        "logs": [f"rank0 {i}" for i in range(5)],
        "stream": "end",
        "bytes": 256 * 40,
        "files": ["async/a.txt"],
    }


NOT_NOW = {"code": "database_unavailable", "message": "the database is not answering", "field": None}


class NotNow(httpx.BaseTransport):
    """In front of the app, as a proxy would be: the first ``times`` requests whose path ends with ``suffix`` get
    the API's 503 (``Retry-After: 0``); every request is counted, then the app answers."""

    def __init__(self, app: TestClient, suffix: str, times: int):
        self.app, self.suffix, self.left, self.seen = app, suffix, times, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith(self.suffix):
            self.seen += 1
            if self.left:
                self.left -= 1
                return httpx.Response(503, json=NOT_NOW, headers={"Retry-After": "0"})
        answer = self.app.request(
            request.method, str(request.url), headers=dict(request.headers), content=request.read()
        )
        return httpx.Response(answer.status_code, headers=dict(answer.headers), content=answer.content)


def _behind(app: FastAPI, token: str, suffix: str, times: int, **kw: Any) -> tuple[Client, NotNow]:
    proxy = NotNow(TestClient(app), suffix, times)
    return Client(http=httpx.Client(transport=proxy, base_url="http://testserver", headers=auth(token)), **kw), proxy


def test_reads_and_idempotent_writes_ride_out_a_503(app: FastAPI, settings: Settings, token: str) -> None:
    job_id = finished_job(settings)
    sdk, proxy = _behind(app, token, job_id, 2)
    assert sdk.get_job(job_id)["id"] == job_id and proxy.seen == 3  # two 503s, then the answer
    body = {"kind": "preprocess", "input": "x.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o"}
    sdk, proxy = _behind(app, token, "/v1/jobs", 1)
    with pytest.raises(ServerError) as refused:  # a POST without an Idempotency-Key is never sent twice
        sdk.create_job(body)
    assert refused.value.status == 503 and refused.value.code == "database_unavailable" and proxy.seen == 1
    sdk, proxy = _behind(app, token, "/v1/jobs", 2)
    with pytest.raises(ValidationError):  # sent again after each 503: the app's own answer (no such input) comes
        sdk.create_job(body, idempotency_key="k-1")
    assert proxy.seen == 3
    sdk, proxy = _behind(app, token, job_id, 10, max_retries=2)
    with pytest.raises(ServerError):  # gives up after max_retries
        sdk.get_job(job_id)
    assert proxy.seen == 3


def test_the_stream_reconnects_after_a_503(app: FastAPI, settings: Settings, token: str) -> None:
    job_id = finished_job(settings)
    with TestClient(app, headers=auth(token)) as http:
        whole = list(Client(http=http).stream(job_id))
    sdk, proxy = _behind(app, token, "/stream", 2)
    assert list(sdk.stream(job_id)) == whole and proxy.seen == 3
    sdk, proxy = _behind(app, token, "/stream", 10)
    with pytest.raises(ServerError):
        list(sdk.stream(job_id, retries=1))
    assert proxy.seen == 2


def test_retry_delay_follows_retry_after_within_bounds() -> None:
    assert _common.retry_delay(httpx.Headers({"Retry-After": "7"}), 0) == 7.0
    assert _common.retry_delay({"retry-after": "100000"}, 0) == _common.MAX_RETRY_AFTER_S
    assert _common.retry_delay({"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}, 1) == _common.RETRY_DELAYS_S[1]
    assert _common.retry_delay({}, 99) == _common.RETRY_DELAYS_S[-1]
    for broken in ("nan", "-1", "inf"):  # never a sleep that raises or never ends: the table instead
        assert _common.retry_delay({"retry-after": broken}, 0) == _common.RETRY_DELAYS_S[0]
    assert _common.may_retry("get", None) and not _common.may_retry("POST", {"Content-Type": "x"})
    assert _common.may_retry("POST", {"Idempotency-Key": "k"})


class AsyncNotNow(httpx.AsyncBaseTransport):
    """``NotNow`` for the async client: the first ``times`` requests get the API's 503, then the app answers."""

    def __init__(self, app: FastAPI, times: int):
        self.inner, self.left, self.seen = httpx.ASGITransport(app=app), times, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen += 1
        if self.left:
            self.left -= 1
            return httpx.Response(503, json=NOT_NOW, headers={"Retry-After": "0"})
        return await self.inner.handle_async_request(request)


def test_async_client_rides_out_a_503(app: FastAPI, settings: Settings, token: str) -> None:
    job_id = finished_job(settings)
    proxy = AsyncNotNow(app, 2)

    async def read() -> tuple[str, list[str]]:
        http = httpx.AsyncClient(transport=proxy, base_url="http://test", headers=auth(token))
        async with AsyncClient(http=http) as sdk:
            job = await sdk.get_job(job_id)
            proxy.left = 1
            return job["id"], [m.event async for m in sdk.stream(job_id)]

    got_id, events = asyncio.run(read())
    assert got_id == job_id and events[-1] == "end" and proxy.seen == 5  # 2 + 1 refused, then each answered
