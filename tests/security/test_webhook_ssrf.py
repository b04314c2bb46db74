"""Finding 2: webhook URLs must not reach internal services. Hostile targets are only registered (never contacted);
deliveries go to the loopback receiver alone, and only where the admin's allow-list names it."""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from security_support import Receiver, finish_job

from app.main import create_app
from core import net_guard, webhooks
from core.settings import Settings
from core_support import auth, isolated_settings, make_token

HOSTILE = [
    "https://169.254.169.254/latest/meta-data/iam/",  # cloud metadata (link-local)
    "https://[fd00:ec2::254]/latest/meta-data/",  # AWS metadata over IPv6 (unique local)
    "https://100.100.100.200/latest/meta-data/",  # Alibaba metadata (shared address space)
    "https://127.0.0.1:6379/",  # Redis
    "https://127.0.0.1:5432/",  # PostgreSQL
    "https://localhost:8000/v1/jobs",  # the API itself, by name
    "https://[::1]/",
    "https://[::ffff:127.0.0.1]/",  # loopback mapped into IPv6
    "https://0.0.0.0/",
    "https://10.0.0.1/",
    "https://172.16.5.4/",
    "https://192.168.1.1/",
    "https://224.0.0.1/",
    "https://240.0.0.1/",  # multicast, reserved
    # issue 25: IPv6 forms that carry a loopback IPv4 address, and reserved IPv4 ranges ipaddress calls global
    "https://[64:ff9b::7f00:1]/",  # NAT64
    "https://[::127.0.0.1]/",  # IPv4-compatible
    "https://[2002:7f00:1::]/",  # 6to4
    "https://192.88.99.1/",  # 6to4 relay anycast
    "https://[64:ff9b::a9fe:a9fe]/",  # NAT64 of the cloud metadata address
    "https://[2002:a00:1::]/",  # 6to4 of 10.0.0.1
    "https://[64:ff9b:1::a00:1]/",  # local-use NAT64
    "https://198.18.0.1/",  # benchmarking
    "https://192.0.2.1/",  # documentation (TEST-NET-1, -2, -3)
    "https://198.51.100.7/",
    "https://203.0.113.9/",
    "https://[2001:db8::1]/",
    "https://255.255.255.255/",
    "http://8.8.8.8/hook",  # public, but not https
    "https://8.8.8.8/" + "a" * 70_000,  # the 70 KB URL that stalled every team's deliveries
]


def _register(client: TestClient, token: str, url: str) -> Any:
    return client.post("/v1/webhooks", json={"url": url}, headers=auth(token))


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, str]]:
    """One service and alpha's token for every hostile target: a refused registration stores nothing, so they share
    it; each checks after its own that alpha has no webhook (one that stored one fails there itself)."""
    settings = isolated_settings(tmp_path_factory.mktemp("ssrf"))
    with TestClient(create_app(settings, reconcile=False)) as client:
        yield client, make_token(settings, "alpha")


@pytest.mark.parametrize("url", HOSTILE, ids=lambda u: u[:40])
def test_hostile_targets_are_refused_at_registration(registry: tuple[TestClient, str], url: str) -> None:
    client, token = registry
    answer = _register(client, token, url)
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "url" and answer.json()["code"] == "validation_error"
    assert client.get("/v1/webhooks", headers=auth(token)).json()["data"] == []


def test_the_admin_allow_list_admits_an_internal_receiver(settings: Settings, receiver: Receiver) -> None:
    from app.main import create_app

    allowed = settings.model_copy(update={"webhook_allowed_hosts": ["127.0.0.1"]})
    with TestClient(create_app(allowed, reconcile=False)) as client:
        assert _register(client, make_token(allowed, "alpha"), receiver.url).status_code == 201
    finish_job(allowed, "alpha")
    assert webhooks.run_once(allowed) == 1 and len(receiver.seen) == 1


def test_webhooks_per_team_are_capped(settings: Settings) -> None:
    from app.main import create_app

    capped = settings.model_copy(update={"webhook_allowed_hosts": ["127.0.0.0/8"], "webhook_max_per_team": 2})
    with TestClient(create_app(capped, reconcile=False)) as client:
        token = make_token(capped, "alpha")
        assert [_register(client, token, f"http://127.0.0.1:{9000 + i}/").status_code for i in range(2)] == [201, 201]
        third = _register(client, token, "http://127.0.0.1:9100/")
        assert third.status_code == 409 and third.json()["field"] == "url"
        assert _register(client, make_token(capped, "beta"), "http://127.0.0.1:9100/").status_code == 201


def _deliveries(client: TestClient, token: str) -> list[dict[str, Any]]:
    hook = client.get("/v1/webhooks", headers=auth(token)).json()["data"][0]
    return client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=auth(token)).json()["data"]


def test_each_delivery_rechecks_the_address(settings: Settings, receiver: Receiver) -> None:
    """Allowed at registration, then the admin takes the receiver off the list: nothing is sent any more."""
    from app.main import create_app

    allowed = settings.model_copy(update={"webhook_allowed_hosts": ["127.0.0.1"]})
    token = make_token(settings, "alpha")
    with TestClient(create_app(allowed, reconcile=False)) as client:
        assert _register(client, token, receiver.url).status_code == 201
        finish_job(settings, "alpha")
        webhooks.run_once(settings)  # the default settings: no allow-list
        attempt = _deliveries(client, token)[0]["attempt_log"][0]
    assert receiver.seen == []
    assert attempt["error"] == net_guard.BLOCKED_REASON and attempt["status_code"] is None


def _fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> None:
    """DNS is the outside boundary: answer from ``answers`` (a list is consumed one answer per lookup)."""
    real = socket.getaddrinfo

    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in answers:
            return real(host, port, *args, **kwargs)
        ip = answers[host].pop(0) if len(answers[host]) > 1 else answers[host][0]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, int(port or 443)))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)  # every resolver (net_guard, the engine) asks it


def test_dns_rebinding_to_loopback_is_not_followed(
    client: TestClient, settings: Settings, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Public when registered, loopback when delivered: refused at delivery, the receiver never hears of it."""
    _fake_dns(monkeypatch, {"hooks.rebind.test": ["93.184.216.34", "127.0.0.1"]})
    token = make_token(settings, "alpha")
    assert _register(client, token, f"https://hooks.rebind.test:{receiver.port}/hook").status_code == 201
    finish_job(settings, "alpha")
    webhooks.run_once(settings)
    assert receiver.seen == []
    assert _deliveries(client, token)[0]["attempt_log"][0]["error"] == net_guard.BLOCKED_REASON


def test_the_post_goes_to_the_checked_address_with_the_name_as_host(
    settings: Settings, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.main import create_app

    _fake_dns(monkeypatch, {"hooks.internal.test": ["127.0.0.1"]})
    allowed = settings.model_copy(update={"webhook_allowed_hosts": ["hooks.internal.test"]})
    with TestClient(create_app(allowed, reconcile=False)) as client:
        url = f"http://hooks.internal.test:{receiver.port}/hook"
        assert _register(client, make_token(allowed, "alpha"), url).status_code == 201
    job_id = finish_job(allowed, "alpha")
    webhooks.run_once(allowed)
    ((headers, body),) = receiver.seen
    assert headers["host"] == f"hooks.internal.test:{receiver.port}" and json.loads(body)["data"]["id"] == job_id


def test_failures_are_reported_coarsely(settings: Settings) -> None:
    """A closed port and an open one that is not HTTP read the same to the tenant: no port scanner."""
    from app.main import create_app

    allowed = settings.model_copy(update={"webhook_allowed_hosts": ["127.0.0.1"]})
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    try:
        errors = []
        for port in (listener.getsockname()[1], closed.getsockname()[1]):
            with TestClient(create_app(allowed, reconcile=False)) as client:
                token = make_token(allowed, f"team{port}")
                assert _register(client, token, f"http://127.0.0.1:{port}/").status_code == 201
                listener.settimeout(0.1)
                finish_job(allowed, f"team{port}")
                fast = allowed.model_copy(update={"webhook_timeout_s": 0.5})
                webhooks.run_once(fast)
                errors.append(_deliveries(client, token)[0]["attempt_log"][0]["error"])
        assert errors[1] == "connection failed" and errors[0] in ("connection failed", "timed out")
        assert not any("Error" in e or str(listener.getsockname()[1]) in e for e in errors)
    finally:
        listener.close()
        closed.close()


@pytest.mark.parametrize("address", ["8.8.8.8", "2606:4700:4700::1111", "64:ff9b::808:808", "2002:808:808::"])
def test_public_addresses_and_their_ipv6_forms_pass(address: str) -> None:
    assert net_guard._public(ipaddress.ip_address(address))


def test_a_literal_address_is_checked_again_at_delivery(settings: Settings) -> None:
    """Registered while an admin listed it (or before the ranges were refused), delivered after: blocked before any
    connection, like a DNS name's."""
    from app.main import create_app

    allowed = settings.model_copy(update={"webhook_allowed_hosts": ["192.88.99.0/24"]})
    token = make_token(settings, "alpha")
    with TestClient(create_app(allowed, reconcile=False)) as client:
        assert _register(client, token, "https://192.88.99.1/hook").status_code == 201
        finish_job(settings, "alpha")
        webhooks.run_once(settings)
        attempt = _deliveries(client, token)[0]["attempt_log"][0]
    assert attempt["error"] == net_guard.BLOCKED_REASON and attempt["status_code"] is None
