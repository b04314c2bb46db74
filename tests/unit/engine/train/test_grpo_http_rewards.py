"""Stage grpo's http rewards against a real local reward service (http.server in a thread): batching, the answer's
protocol, timeouts, 500s, garbage and wrong-length answers scored NaN and counted (never raising), retries, the
address rules at submission (422 naming the field) and again before every POST (a name that resolves to loopback
later is not followed), and the allow decision the service records in the spec."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from core.errors import ApiError
from core.reward_hosts import check_http_rewards, stamp_allowed_hosts
from core.settings import Settings
from core_support import auth, isolated_settings, team_dir
from engine.contract.spec import RewardFunc, TrainSpec, first_error, parse_spec
from engine.train.http_rewards import HttpReward
from engine.train.rewards import Completion, build_rewards, json_rewards, score
from tests.unit.engine.contract.test_grpo_spec import BASE
from train_support import TINY_SHAPE


class Service:
    """A reward service whose behaviour each test picks: ``mode`` (per path) and a log of what it received."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.hosts: list[str] = []
        self.fail_first = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self.server.server_address[1]

    def url(self, mode: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/{mode}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                service.seen.append(body)
                service.hosts.append(self.headers["host"])
                items = body["items"]
                mode = self.path.strip("/")
                if mode == "flaky" and service.fail_first > 0:
                    service.fail_first -= 1
                    mode = "error"
                answer: Any = {"rewards": [len(i["completion"]) if i["completion"] != "skip" else None for i in items]}
                if mode == "slow":
                    time.sleep(1.0)
                elif mode == "error":
                    self.send_response(500)
                    self.end_headers()
                    return
                elif mode == "garbage":
                    answer = "<html>not json"
                elif mode == "short":
                    answer = {"rewards": answer["rewards"][:-1]}
                elif mode == "strings":
                    answer = {"rewards": ["1"] * len(items)}
                data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def service() -> Iterator[Service]:
    s = Service()
    threading.Thread(target=s.server.serve_forever, daemon=True).start()
    yield s
    s.server.shutdown()
    s.server.server_close()


def _reward(url: str, **fields: Any) -> HttpReward:
    return HttpReward(RewardFunc(name="http", url=url, allowed_hosts=fields.pop("allowed", ["127.0.0.1"]), **fields))


ITEMS = [{"prompt": "p", "completion": "x" * n, "reference": "r"} for n in range(1, 6)]


def test_batches_are_posted_and_scored_in_order(service: Service) -> None:
    values, failures = _reward(service.url("ok"), batch_size=2).score(ITEMS)
    assert values == [1.0, 2.0, 3.0, 4.0, 5.0] and failures == 0
    assert [len(b["items"]) for b in service.seen] == [2, 2, 1]
    assert service.seen[0]["items"][0] == {"prompt": "p", "completion": "x", "reference": "r"}


def test_a_null_reward_is_nan_and_not_a_failure(service: Service) -> None:
    items = [*ITEMS[:2], {"prompt": "p", "completion": "skip", "reference": "r"}]
    values, failures = _reward(service.url("ok")).score(items)
    assert values[:2] == [1.0, 2.0] and math.isnan(values[2]) and failures == 0


@pytest.mark.parametrize("mode", ["error", "garbage", "short", "strings", "slow"])
def test_a_failing_service_scores_nan_and_counts_never_raising(service: Service, mode: str) -> None:
    started = time.monotonic()
    values, failures = _reward(service.url(mode), retries=1, timeout_s=0.3, batch_size=3).score(ITEMS)
    assert all(math.isnan(v) for v in values) and failures == len(ITEMS)
    assert len(service.seen) == 4  # two batches, each tried twice
    assert time.monotonic() - started < 6  # timeouts bound the wait (0.3 s per try, 0.5 s backoff)


def test_a_batch_that_fails_once_is_retried(service: Service) -> None:
    service.fail_first = 1
    values, failures = _reward(service.url("flaky"), retries=2).score(ITEMS[:2])
    assert values == [1.0, 2.0] and failures == 0 and len(service.seen) == 2


def test_loopback_not_allowed_by_the_admin_is_never_contacted(service: Service) -> None:
    values, failures = _reward(service.url("ok"), allowed=[]).score(ITEMS)
    assert all(math.isnan(v) for v in values) and failures == len(ITEMS) and service.seen == []


def _fake_dns(monkeypatch: pytest.MonkeyPatch, name: str, ip: str) -> None:
    """DNS is the outside boundary: ``name`` resolves to ``ip``."""
    real = socket.getaddrinfo

    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != name:
            return real(host, port, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, int(port or 443)))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_name_rebound_to_loopback_is_refused_before_the_post(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Public at submission (no allow entry recorded), loopback at the worker: the engine refuses it."""
    _fake_dns(monkeypatch, "rewards.rebind.test", "127.0.0.1")
    values, failures = _reward(service.url("ok", "rewards.rebind.test"), allowed=[]).score(ITEMS[:2])
    assert failures == 2 and all(math.isnan(v) for v in values) and service.seen == []


def test_an_allowed_name_goes_to_the_checked_address_with_its_host(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_dns(monkeypatch, "rewards.internal.test", "127.0.0.1")
    reward = _reward(service.url("ok", "rewards.internal.test"), allowed=["rewards.internal.test"])
    assert reward.score(ITEMS[:1]) == ([1.0], 0)
    assert service.hosts == [f"rewards.internal.test:{service.port}"]


def test_score_mixes_rule_and_http_rewards_and_rows_write_null(service: Service) -> None:
    funcs = [
        RewardFunc(name="exact_match"),
        RewardFunc(name="http", url=service.url("error"), retries=0, allowed_hosts=["127.0.0.1"]),
    ]
    completions = [Completion("a", 1, False, "a", "q"), Completion("b", 1, False, "a", "q")]
    scores = score(build_rewards(funcs, 8), completions)
    assert [row[0] for row in scores.values] == [1.0, 0.0] and all(math.isnan(row[1]) for row in scores.values)
    assert scores.failures == {"exact_match": 0, "http": 2}
    assert json_rewards(["exact_match", "http"], scores.values[0]) == {"exact_match": 1.0, "http": None}
    assert service.seen[0]["items"][0] == {"prompt": "q", "completion": "a", "reference": "a"}


# ---------------------------------------------------------------- at submission

SPEC = {k: v for k, v in BASE.items() if k != "reward_funcs"}


def _spec(url: str, **fields: Any) -> TrainSpec:
    spec = parse_spec({**SPEC, "reward_funcs": [{"name": "exact_match"}, {"name": "http", "url": url, **fields}]})
    assert isinstance(spec, TrainSpec)
    return spec


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:9/r", "https://10.1.2.3/r", "https://169.254.169.254/", "http://8.8.8.8/"]
)
def test_submission_refuses_addresses_the_admin_did_not_allow(tmp_path: Path, url: str) -> None:
    with pytest.raises(ApiError) as err:
        check_http_rewards(_spec(url), isolated_settings(tmp_path))
    assert err.value.status == 422 and err.value.field == "reward_funcs.1.url", err.value


def test_the_admin_decision_is_recorded_and_a_submitters_own_is_replaced(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, webhook_allowed_hosts=["10.0.0.0/8", "127.0.0.1"])
    spec = _spec("http://127.0.0.1:9/r", allowed_hosts=["0.0.0.0/0"])
    check_http_rewards(spec, settings)
    stamp_allowed_hosts(spec, settings)
    assert spec.reward_funcs[1].allowed_hosts == ["127.0.0.1"]
    public = _spec("https://8.8.8.8/r", allowed_hosts=["0.0.0.0/0"])
    stamp_allowed_hosts(public, settings)
    assert public.reward_funcs[1].allowed_hosts == []


@pytest.mark.parametrize(
    ("reward", "field"),
    [
        ({"name": "http"}, "url"),
        ({"name": "http", "url": "ftp://x.test/"}, "url"),
        ({"name": "exact_match", "url": "https://x.test/"}, "url"),
        ({"name": "contains", "batch_size": 4}, "batch_size"),
        ({"name": "http", "url": "https://x.test/", "timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_http_reward_fields_are_named(reward: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({**SPEC, "reward_funcs": [reward]})
    assert first_error(err.value, "spec").split(":")[0].split(".")[-1] == field, first_error(err.value, "spec")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = isolated_settings(tmp_path)
    for suffix in (".bin", ".idx"):  # the data_path prefix "d" exists (admission checks inputs)
        (team_dir(settings, "alpha") / f"d{suffix}").write_bytes(b"")
    return settings


def test_the_api_refuses_a_private_url_and_stores_the_allow_decision(client: TestClient, token: str) -> None:
    """Through POST /v1/jobs: 422 naming the reward's url; a public URL is admitted and the stored spec's
    allowed_hosts is the service's decision (none), not the submitter's."""
    spec = {**SPEC, **TINY_SHAPE}
    http = {"name": "http", "url": "http://127.0.0.1:9/score"}
    refused = client.post("/v1/jobs", json={**spec, "reward_funcs": [http]}, headers=auth(token))
    assert refused.status_code == 422 and refused.json()["field"] == "reward_funcs.0.url", refused.text
    public = {"name": "http", "url": "https://8.8.8.8/score", "allowed_hosts": ["0.0.0.0/0"]}
    created = client.post("/v1/jobs", json={**spec, "reward_funcs": [public]}, headers=auth(token))
    assert created.status_code == 201, created.text
    stored = client.get(f"/v1/jobs/{created.json()['id']}", headers=auth(token)).json()["spec"]
    assert stored["reward_funcs"][0]["allowed_hosts"] == []
