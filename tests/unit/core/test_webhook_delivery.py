"""Webhooks against a real HTTP receiver on 127.0.0.1: Standard-Webhooks signature, retry after a 500 with the same
webhook-id, every attempt recorded, team isolation, event filters, giving up, and the API's background sender."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from standardwebhooks.webhooks import Webhook as StandardWebhook
from standardwebhooks.webhooks import WebhookVerificationError

from app.main import create_app
from core import webhooks
from core.db import alembic_config, session_scope
from core.jobs import add_event, transition
from core.settings import Settings
from core.states import JobState
from core_support import auth, isolated_settings, make_job, make_token


@dataclass
class Receiver:
    url: str
    statuses: list[int]  # answers, in order; the last one repeats
    seen: list[tuple[dict[str, str], bytes]] = field(default_factory=list)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    box = Receiver("", [200])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["content-length"]))
            box.seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
            status = box.statuses[min(len(box.seen), len(box.statuses)) - 1]
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b"ok" if status < 300 else b"try later")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield box
    server.shutdown()
    server.server_close()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(
        tmp_path,
        webhook_backoff_s=0.2,
        webhook_max_attempts=3,
        webhook_poll_s=0.2,
        webhook_settle_s=0,
        webhook_allowed_hosts=["127.0.0.1"],
    )  # the loopback receiver


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """A receiver's check, written from the Standard Webhooks spec (not with core.webhooks)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(hmac.compare_digest(sig.removeprefix("v1,"), expected) for sig in headers["webhook-signature"].split())


def register(client: TestClient, token: str, url: str, **extra: Any) -> dict[str, Any]:
    response = client.post("/v1/webhooks", json={"url": url, **extra}, headers=auth(token))
    assert response.status_code == 201, response.text
    return response.json()


def finish_job(settings: Settings, team: str, state: JobState = JobState.succeeded, checkpoint: bool = False) -> str:
    job_id = make_job(settings, team=team)
    with session_scope(settings.database_url) as session:
        transition(session, job_id, JobState.starting, attempt_count=1)
        transition(session, job_id, JobState.running)
        if checkpoint:
            add_event(session, job_id, "checkpoint", "saved", data={"iteration": 5, "path": "/ckpt/iter_0000005"})
            session.commit()
        values = (
            {"result": {"outputs": {"data_path": "/d"}}}
            if state is JobState.succeeded
            else {"error_code": "engine_error"}
        )
        transition(session, job_id, state, **values)
    return job_id


def test_signed_delivery_is_retried_after_a_500(client: TestClient, settings: Settings, receiver: Receiver) -> None:
    token = make_token(settings, "alpha")
    hook = register(client, token, receiver.url)
    assert hook["secret"].startswith("whsec_") and hook["events"] == ["job.succeeded", "job.failed", "job.cancelled"]
    receiver.statuses = [500, 200]
    job_id = finish_job(settings, "alpha")

    assert webhooks.run_once(settings) == 1  # 500 -> pending, retried after the backoff
    assert webhooks.run_once(settings) == 0  # not due yet
    time.sleep(0.3)
    assert webhooks.run_once(settings) == 1
    assert webhooks.run_once(settings) == 0  # delivered: never again

    (first, body1), (second, body2) = receiver.seen
    assert first["webhook-id"] == second["webhook-id"] and first["webhook-id"].startswith("msg_")
    assert verify(hook["secret"], first, body1) and verify(hook["secret"], second, body2)
    assert not verify(hook["secret"], second, body2.replace(b"succeeded", b"failed"))
    assert abs(int(second["webhook-timestamp"]) - time.time()) < 60
    message = json.loads(body2)
    assert message["type"] == "job.succeeded" and message["object"] == "event"
    assert message["data"]["id"] == job_id and message["data"]["outputs"] == {"data_path": "/d"}

    listed = client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=auth(token)).json()["data"]
    assert len(listed) == 1 and listed[0]["state"] == "delivered" and listed[0]["id"] == first["webhook-id"]
    assert [a["status_code"] for a in listed[0]["attempt_log"]] == [500, 200]
    assert client.get(f"/v1/webhooks/{hook['id']}", headers=auth(token)).json()["secret"] is None


def test_only_the_teams_subscribed_events_are_sent(client: TestClient, settings: Settings, receiver: Receiver) -> None:
    alpha, beta = make_token(settings, "alpha"), make_token(settings, "beta")
    register(client, alpha, receiver.url, events=["job.failed", "job.checkpoint"])
    finish_job(settings, "beta", JobState.failed)  # another team's job
    finish_job(settings, "alpha", JobState.succeeded)  # not subscribed
    failed = finish_job(settings, "alpha", JobState.failed, checkpoint=True)
    webhooks.run_once(settings)
    types = [json.loads(body)["type"] for _, body in receiver.seen]
    assert sorted(types) == ["job.checkpoint", "job.failed"]
    checkpoint = next(json.loads(b) for _, b in receiver.seen if json.loads(b)["type"] == "job.checkpoint")
    assert checkpoint["data"]["id"] == failed and checkpoint["data"]["checkpoint"]["iteration"] == 5
    assert client.get("/v1/webhooks", headers=auth(beta)).json()["data"] == []


def test_a_receiver_that_keeps_failing_is_given_up(client: TestClient, settings: Settings, receiver: Receiver) -> None:
    token = make_token(settings, "alpha")
    hook = register(client, token, receiver.url)
    receiver.statuses = [503]
    finish_job(settings, "alpha", JobState.cancelled)
    deadline = time.monotonic() + 10
    while len(receiver.seen) < 3 and time.monotonic() < deadline:
        webhooks.run_once(settings)
        time.sleep(0.1)
    time.sleep(1.0)
    webhooks.run_once(settings)
    assert len(receiver.seen) == 3  # webhook_max_attempts
    delivery = client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=auth(token)).json()["data"][0]
    assert delivery["state"] == "failed" and delivery["attempts"] == 3 and delivery["last_status"] == 503


def test_connection_errors_are_recorded(client: TestClient, settings: Settings) -> None:
    token = make_token(settings, "alpha")
    hook = register(client, token, "http://127.0.0.1:9/nothing-listens")
    finish_job(settings, "alpha")
    webhooks.run_once(settings)
    delivery = client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=auth(token)).json()["data"][0]
    assert delivery["state"] == "pending" and delivery["attempt_log"][0]["status_code"] is None
    assert delivery["attempt_log"][0]["error"] == "connection failed"  # coarse: no port-scanner detail


def test_disabled_webhooks_send_nothing(client: TestClient, settings: Settings, receiver: Receiver) -> None:
    token = make_token(settings, "alpha")
    hook = register(client, token, receiver.url)
    assert client.delete(f"/v1/webhooks/{hook['id']}", headers=auth(token)).json()["disabled_at"]
    finish_job(settings, "alpha")
    webhooks.run_once(settings)
    assert receiver.seen == []


def test_deleting_a_webhook_stops_its_claimed_and_retried_messages(
    client: TestClient, settings: Settings, receiver: Receiver
) -> None:
    """A sender pass claims a batch and POSTs it one by one; a webhook deleted meanwhile gets nothing more, and its
    messages waiting for a retry are never sent (issue 25: deliveries went on for ~22 s)."""
    token = make_token(settings, "alpha")
    hook = register(client, token, receiver.url)
    receiver.statuses = [500]
    finish_job(settings, "alpha")
    assert webhooks.run_once(settings) == 1 and len(receiver.seen) == 1  # failed: a retry is due after the backoff
    finish_job(settings, "alpha")
    time.sleep(0.3)
    webhooks.fan_out(settings, webhooks.Watermark(0))
    claimed = webhooks.claim_due(settings)
    assert len(claimed) == 2  # the retry and the new message, in flight in this pass
    assert client.delete(f"/v1/webhooks/{hook['id']}", headers=auth(token)).status_code == 200
    assert [webhooks.deliver(settings, item) for item in claimed] == [None, None]
    time.sleep(0.3)
    assert webhooks.run_once(settings) == 0 and len(receiver.seen) == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"url": "ftp://x/y"}, "url"),
        ({"url": "http://x/y", "secret": "plain"}, "secret"),
        ({"url": "http://x/y", "events": ["job.started"]}, "events.0"),
    ],
)
def test_bad_registrations_are_422(client: TestClient, settings: Settings, body: dict[str, Any], field: str) -> None:
    response = client.post("/v1/webhooks", json=body, headers=auth(make_token(settings, "alpha")))
    assert response.status_code == 422 and response.json()["field"] == field


def test_the_api_sends_in_the_background(settings: Settings, receiver: Receiver) -> None:
    token = make_token(settings, "alpha")
    with TestClient(create_app(settings)) as client:  # the lifespan starts the sender
        hook = register(client, token, receiver.url, secret="whsec_" + base64.b64encode(b"k" * 32).decode())
        finish_job(settings, "alpha")
        deadline = time.monotonic() + 15
        while not receiver.seen and time.monotonic() < deadline:
            time.sleep(0.1)
    assert receiver.seen and verify(hook["secret"], *receiver.seen[0])


def test_webhook_migration_is_the_single_head_and_reverts(tmp_path: Path) -> None:
    from alembic import command
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine, inspect

    url = f"sqlite:///{tmp_path / 'm.db'}"
    config = alembic_config(url)
    assert len(ScriptDirectory.from_config(config).get_heads()) == 1
    command.upgrade(config, "0003")
    command.downgrade(config, "0002")
    engine = create_engine(url)
    assert not {"webhooks", "webhook_deliveries", "webhook_attempts"} & set(inspect(engine).get_table_names())
    engine.dispose()
    command.upgrade(config, "head")


def test_the_watermark_waits_for_transactions_that_may_still_commit_lower_ids() -> None:
    mark = webhooks.Watermark(settle_s=2.0)
    assert mark.update(10, now=0.0) == 0  # id 9 may still be in an open transaction
    assert mark.update(20, now=1.0) == 0
    assert mark.update(25, now=2.5) == 10  # what was the max 2 s ago is complete now
    assert mark.update(25, now=3.5) == 20
    assert mark.update(30, now=100.0) == 25  # 30 was first seen just now
    assert mark.update(30, now=102.0) == 30
    assert webhooks.Watermark(settle_s=0).update(7) == 7


def test_a_fresh_event_waits_for_the_settle_time(client: TestClient, settings: Settings, receiver: Receiver) -> None:
    slow = settings.model_copy(update={"webhook_settle_s": 0.5})
    register(client, make_token(settings, "alpha"), receiver.url)
    sender = webhooks.Sender(slow)
    try:
        finish_job(settings, "alpha")
        assert sender.tick() == 0 and receiver.seen == []
        time.sleep(0.6)
        assert sender.tick() == 1 and len(receiver.seen) == 1
    finally:
        sender.close()


def test_signatures_are_the_standard_webhooks_library_s_and_the_spec_s() -> None:
    """The signing goes through `standardwebhooks`; its signature equals the spec's HMAC written out here, and the
    library's own receiver-side check accepts our headers (a timestamp of now: it refuses stale ones)."""
    secret, body, msg_id = webhooks.new_secret(), b'{"object":"event","id":"evt_1"}', "msg_fixed"
    headers = webhooks.headers(secret, msg_id, 1_700_000_000, body)
    assert verify(secret, headers, body)
    assert headers["webhook-signature"] == webhooks.sign(secret, msg_id, 1_700_000_000, body)
    fresh = webhooks.headers(secret, msg_id, int(time.time()), body)
    assert StandardWebhook(secret).verify(body, fresh) == json.loads(body)
    tampered = {**fresh, "webhook-id": "msg_other"}
    with pytest.raises(WebhookVerificationError):
        StandardWebhook(secret).verify(body, tampered)
