"""The OpenAI routes' proxy against an engine that misbehaves (issue 39, findings 2, 4 and 6): a team past its
concurrent-request limit gets 429 with Retry-After in OpenAI's shape while another team is served; a wrongly typed
field is a 400 before anything reaches the engine; a client leaving a non-stream request closes the engine's answer;
an engine that goes silent or refuses connections is a 503 ``model_not_ready`` (an SSE error event once a stream
began) and is left out of ``/v1/models`` until its unhealthy mark runs out; one pooled client per engine URL, closed
with the app. The API runs under uvicorn on loopback; the engine is a stub of its HTTP side (``engine_stub``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_stub import Behaviour, StubEngine, stub_engine
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai_support import deploy, served

from app.api import openai_compat
from core.db import session_scope
from core.models import Job
from core.settings import Settings
from core_support import isolated_settings, make_token
from service_support import free_port

LIMIT, READ_TIMEOUT_S, TTL_S = 2, 1.0, 1.5
MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass
class Api:
    url: str
    app: FastAPI
    settings: Settings
    tokens: dict[str, str]

    def client(self, team: str, timeout: float = 10) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.tokens[team]}"}, timeout=timeout
        )

    def chat(self, team: str, model: str, max_tokens: int = 3, **extra: Any) -> httpx.Response:
        with self.client(team) as http:
            return http.post(
                "/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": max_tokens, **extra}
            )

    def models(self, team: str) -> list[str]:
        with self.client(team) as http:
            return [m["id"] for m in http.get("/v1/models").json()["data"]]


@pytest.fixture
def engine() -> Iterator[StubEngine]:
    with stub_engine() as stub:
        yield stub


@pytest.fixture
def api(tmp_path: Path, engine: StubEngine) -> Iterator[Api]:
    settings = isolated_settings(
        tmp_path, team_max_chat_requests=LIMIT, engine_read_timeout_s=READ_TIMEOUT_S, engine_unhealthy_ttl_s=TTL_S
    )
    deploy(settings, "alpha", "alpha-chat", engine.url)
    deploy(settings, "beta", "beta-chat", engine.url)
    deploy(settings, "alpha", "gone-chat", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    tokens = {team: make_token(settings, team) for team in ("alpha", "beta")}
    with served(settings) as (url, app):
        yield Api(url, app, settings, tokens)


def _error(answer: httpx.Response) -> dict[str, Any]:
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error  # OpenAI's shape
    return error


def test_wrong_types_are_400_naming_the_field_and_never_reach_the_engine(api: Api, engine: StubEngine) -> None:
    for field, value in (("stream_options", "x"), ("stop", [1]), ("stream", "yes"), ("temperature", "hot")):
        answer = api.chat("alpha", "alpha-chat", **{field: value})
        assert answer.status_code == 400, answer.text
        assert _error(answer)["param"] == field
    assert engine.bodies == []
    assert api.chat("alpha", "alpha-chat", stream=True, stream_options={"include_usage": True}).status_code == 200


def _open_stream(stack: ExitStack, api: Api, team: str) -> httpx.Response:
    http = stack.enter_context(api.client(team))
    body = {"model": f"{team}-chat", "messages": MESSAGES, "max_tokens": 200, "stream": True}
    return stack.enter_context(http.stream("POST", "/v1/chat/completions", json=body))


def test_a_team_past_its_limit_gets_429_while_another_team_is_served(api: Api, engine: StubEngine) -> None:
    engine.behaviour = Behaviour(gap_s=0.05)  # answers of max_tokens lines, 50 ms apart: 10 s for 200
    with ExitStack() as first:
        held = [_open_stream(first, api, "alpha") for _ in range(LIMIT)]
        assert [r.status_code for r in held] == [200] * LIMIT
        refused = api.chat("alpha", "alpha-chat")
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "5"
        error = _error(refused)
        assert (error["type"], error["code"]) == ("rate_limit_error", "too_many_requests")
        other = api.chat("beta", "beta-chat")
        assert other.status_code == 200 and other.json()["choices"][0]["message"]["content"] == "aaa"
    deadline = time.monotonic() + 5  # the streams closed: their slots come back once the server sees it
    while (answer := api.chat("alpha", "alpha-chat")).status_code == 429:
        assert time.monotonic() < deadline, "the slots of closed streams never came back"
        time.sleep(0.1)
    assert answer.status_code == 200, answer.text


def test_a_client_leaving_a_non_stream_request_closes_the_engine_answer(api: Api, engine: StubEngine) -> None:
    engine.behaviour = Behaviour(gap_s=0.05)
    with api.client("alpha", timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json={"model": "alpha-chat", "messages": MESSAGES, "max_tokens": 200})
    assert engine.hung_up.wait(5), "the engine kept generating for a client that left"
    deadline = time.monotonic() + 5  # and its slot came back: the whole limit is open again
    while True:
        with ExitStack() as stack:
            statuses = [_open_stream(stack, api, "alpha").status_code for _ in range(LIMIT)]
        if statuses == [200] * LIMIT:
            break
        assert time.monotonic() < deadline, "the slot of the request whose client left never came back"
        time.sleep(0.1)


def test_a_silent_engine_is_503_and_left_out_of_models_until_its_mark_runs_out(api: Api, engine: StubEngine) -> None:
    assert sorted(api.models("alpha")) == ["alpha-chat", "gone-chat"]
    engine.behaviour = Behaviour(silent_after=0)  # accepts, then says nothing
    start = time.monotonic()
    answer = api.chat("alpha", "alpha-chat")
    assert answer.status_code == 503 and _error(answer)["code"] == "model_not_ready", answer.text
    assert READ_TIMEOUT_S <= time.monotonic() - start < READ_TIMEOUT_S + 3
    assert int(answer.headers["Retry-After"]) >= 1
    assert "alpha-chat" not in api.models("alpha")
    reached = len(engine.bodies)
    assert api.chat("alpha", "alpha-chat").status_code == 503 and len(engine.bodies) == reached  # not tried again
    engine.behaviour = Behaviour()
    time.sleep(TTL_S)
    assert "alpha-chat" in api.models("alpha")
    assert api.chat("alpha", "alpha-chat").status_code == 200


def test_an_engine_refusing_connections_is_503_and_not_listed(api: Api) -> None:
    answer = api.chat("alpha", "gone-chat")
    assert answer.status_code == 503 and _error(answer)["code"] == "model_not_ready", answer.text
    assert api.models("alpha") == ["alpha-chat"]


def test_an_engine_silent_mid_stream_ends_the_sse_with_an_error_event(api: Api, engine: StubEngine) -> None:
    engine.behaviour = Behaviour(silent_after=2)  # its start line and one token, then nothing
    with api.client("alpha") as http:
        answer = http.post("/v1/chat/completions", json={"model": "alpha-chat", "messages": MESSAGES, "stream": True})
    events = [line.removeprefix("data: ") for line in answer.text.splitlines() if line.startswith("data: ")]
    assert answer.status_code == 200 and "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["code"] == "model_not_ready" and len(events) >= 2  # its token came first


def test_an_engine_answer_cut_short_is_a_502(api: Api, engine: StubEngine) -> None:
    engine.behaviour = Behaviour(cut_after=1)  # the engine process died mid-answer: no finish, no done
    answer = api.chat("alpha", "alpha-chat")
    assert answer.status_code == 502 and _error(answer)["code"] == "engine_error", answer.text


def test_one_pooled_client_per_engine_url_closed_with_the_app(tmp_path: Path, engine: StubEngine) -> None:
    settings = isolated_settings(tmp_path)
    deploy(settings, "alpha", "alpha-chat", engine.url)
    deploy(settings, "alpha", "alpha-too", engine.url)  # a second deployment on the same engine URL
    token = make_token(settings, "alpha")
    with served(settings) as (url, app):
        connections = engine.connections
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as http:
            for model in ("alpha-chat", "alpha-too", "alpha-chat"):
                answer = http.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES})
                assert answer.status_code == 200, answer.text
        assert engine.connections - connections == 1  # the three requests went over one kept-alive connection
        proxy = app.state.openai_serving.proxy
        assert proxy.urls() == [engine.url]
        client = proxy.client(engine.url)
    assert client.is_closed and proxy.urls() == []


def test_the_token_is_checked_before_the_body_even_without_the_auth_middleware(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    bare = FastAPI()  # the routes alone: no middleware authenticates first
    bare.state.settings = settings
    bare.include_router(openai_compat.router)
    with TestClient(bare) as http:
        for path in ("/v1/chat/completions", "/v1/completions"):
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}):
                answer = http.post(path, content=b"{not json", headers=headers)
                assert answer.status_code == 401, answer.text
                assert _error(answer)["code"] in ("unauthorized", "invalid_api_key")
        good = {"Authorization": f"Bearer {make_token(settings, 'alpha')}"}
        assert http.post("/v1/chat/completions", content=b"{not json", headers=good).status_code == 400


def test_an_engine_failing_a_request_is_a_500_and_an_sse_error_event(api: Api, engine: StubEngine) -> None:
    engine.behaviour = Behaviour(fail_after=1)  # one token, then the engine's error line
    answer = api.chat("alpha", "alpha-chat")
    assert answer.status_code == 500 and _error(answer)["code"] == "engine_error", answer.text
    assert "failed while answering" in _error(answer)["message"]
    with api.client("alpha") as http:
        streamed = http.post("/v1/chat/completions", json={"model": "alpha-chat", "messages": MESSAGES, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith('"code": "engine_error"}}')
    assert "[DONE]" not in streamed.text


def test_the_client_of_a_deployment_gone_is_closed(api: Api, engine: StubEngine) -> None:
    proxy = api.app.state.openai_serving.proxy
    proxy.prune_s = 0  # look for gone deployments at every request
    assert api.chat("alpha", "alpha-chat").status_code == 200
    client = proxy.client(engine.url)
    with session_scope(api.settings.database_url) as session:  # the job ends; another takes its place
        session.query(Job).filter(Job.state == "running").update({"state": "cancelled"})  # beta's too: same URL
    other = engine.url.replace("127.0.0.1", "localhost")  # the same stub under another URL
    deploy(api.settings, "alpha", "alpha-next", other)
    assert api.chat("alpha", "alpha-next").status_code == 200
    assert client.is_closed and engine.url not in proxy.urls() and other in proxy.urls()
