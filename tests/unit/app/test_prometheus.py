"""GET /metrics: admins only, Prometheus text that prometheus_client's own parser reads, with request latency by route
template and the cluster figures read from the database; the optional token-free listener."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from sqlalchemy import select

from app.main import create_app
from core.db import session_scope
from core.models import Event, Host, Job, Lease, MetricPoint, Webhook, WebhookDelivery, utcnow
from core.settings import Settings
from core_support import auth, isolated_settings, make_job, make_token
from service_support import free_port


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


def samples(text: str) -> dict[str, list[Sample]]:
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(found: dict[str, list[Sample]], name: str, **labels: str) -> float:
    family = name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
    return sum(
        s.value for s in found[family] if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def seed_cluster(settings: Settings) -> str:
    """Two queued jobs (one waiting 60 s), one running with a lease and an ingest 4 s behind, a host, a delivery."""
    queued, running = make_job(settings), make_job(settings)
    make_job(settings)
    now = utcnow()
    with session_scope(settings.database_url) as session:
        session.get(Job, queued).created_at = now - timedelta(seconds=60)  # type: ignore[union-attr]
        job = session.get(Job, running)
        assert job is not None
        job.state, job.heartbeat_at = "running", now
        session.add(
            Host(
                name="h1",
                device_type="cpu",
                devices=2,
                device_ids=[0, 1],
                queue="host.h1",
                state="up",
                info={},
                heartbeat_at=now - timedelta(seconds=7),
            )
        )
        session.add(Lease(host="h1", device=0, job_id=running, team="t", attempt=1, node_rank=0))
        session.add(MetricPoint(job_id=running, step=1, name="lm_loss", value=1.0, time=now - timedelta(seconds=4)))
        hook = Webhook(team="t", url="https://example.com/h", events=["job.succeeded"], secret="sealed", cursor=0)
        session.add(hook)
        session.flush()
        event = session.scalars(select(Event.id).where(Event.job_id == running)).first()
        session.add(
            WebhookDelivery(
                id="msg_1",
                webhook_id=hook.id,
                event_id=event,
                job_id=running,
                type="job.succeeded",
                payload={},
                state="delivered",
                created_at=now,
            )
        )
    return running


def test_admin_scrape_parses_with_the_clients_parser(settings: Settings) -> None:
    running = seed_cluster(settings)
    admin, tenant = make_token(settings, "ops", admin=True), make_token(settings, "t")
    with TestClient(create_app(settings, reconcile=False)) as client:
        assert client.get(f"/v1/jobs/{running}", headers=auth(tenant)).status_code == 200
        assert client.get("/v1/jobs/nope", headers=auth(tenant)).status_code == 404
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=auth(tenant)).status_code == 403
        response = client.get("/metrics", headers=auth(admin))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    found = samples(response.text)
    route = "/v1/jobs/{job_id}"
    assert value(found, "llmjobs_http_request_duration_seconds_count", route=route, method="GET", status="200") == 1
    assert value(found, "llmjobs_http_request_duration_seconds_count", route=route, status="404") == 1
    assert value(found, "llmjobs_http_request_duration_seconds_bucket", route=route, status="200", le="+Inf") == 1
    assert value(found, "llmjobs_jobs", state="queued", kind="preprocess") == 2
    assert value(found, "llmjobs_jobs", state="running", kind="preprocess") == 1
    assert 59 <= value(found, "llmjobs_queue_oldest_wait_seconds", queue="llmjobs.cpu") < 120
    assert (
        value(found, "llmjobs_device_leases", host="h1") == 1 and value(found, "llmjobs_host_devices", host="h1") == 2
    )
    assert 6 <= value(found, "llmjobs_host_heartbeat_age_seconds", host="h1") < 60
    assert 3.5 <= value(found, "llmjobs_ingest_lag_seconds") < 10
    assert value(found, "llmjobs_webhook_deliveries", state="delivered") == 1


def test_separate_listener_needs_no_token(tmp_path: Path) -> None:
    port = free_port()
    settings = isolated_settings(tmp_path, metrics_listen_port=port)
    with TestClient(create_app(settings, reconcile=False)) as client:
        client.get("/healthz")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert value(samples(text), "llmjobs_http_request_duration_seconds_count", route="/healthz") == 1
