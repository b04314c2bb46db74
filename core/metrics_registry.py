"""Operational metrics for Prometheus (``prometheus-client``): one registry per API process.

Request latency is observed as requests end (``observe_request``, labelled by route template, method and status).
Everything else is read from the database at scrape time (``ServiceCollector``), so every replica reports the same
cluster-wide figures whichever of them did the work: jobs by state and kind, the oldest waiting job per queue, device
leases in use per host, ingest lag, webhook deliveries by state, and each host's heartbeat age. Names follow the
Prometheus conventions (``llmjobs_`` prefix, base units, ``_seconds``/``_total``, no unit-less ratios).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from core.db import session_scope
from core.models import Host, Job, Lease, MetricPoint, WebhookDelivery, utcnow
from core.states import WAITING, JobState

log = logging.getLogger(__name__)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _age(now: datetime, then: datetime | None) -> float:
    return max(0.0, (now - then).total_seconds()) if then is not None else 0.0


class ServiceCollector(Collector):
    """Cluster state read from the database on each scrape (a few grouped queries)."""

    def __init__(self, database_url: str):
        self.database_url = database_url

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            yield from self._collect()
        except Exception as err:  # noqa: BLE001 - a scrape during a database outage still returns the request metrics
            log.warning("metrics: database figures unavailable: %s", err)

    def _collect(self) -> Iterator[GaugeMetricFamily]:
        now = utcnow()
        jobs = GaugeMetricFamily("llmjobs_jobs", "Jobs by state and kind.", labels=["state", "kind"])
        oldest = GaugeMetricFamily(
            "llmjobs_queue_oldest_wait_seconds",
            "How long the oldest waiting (queued or retrying) job of a queue has waited.",
            labels=["queue"],
        )
        leases = GaugeMetricFamily("llmjobs_device_leases", "Devices leased to jobs, per host.", labels=["host"])
        devices = GaugeMetricFamily(
            "llmjobs_host_devices", "Devices a registered host offers.", labels=["host", "device_type"]
        )
        heartbeat = GaugeMetricFamily(
            "llmjobs_host_heartbeat_age_seconds", "Seconds since a host's worker last heart-beat.", labels=["host"]
        )
        lag = GaugeMetricFamily(
            "llmjobs_ingest_lag_seconds",
            "For running jobs, the largest delay between the engine "
            "writing a metric point and its worker storing it (at the last ingest).",
        )
        hooks = GaugeMetricFamily("llmjobs_webhook_deliveries", "Webhook messages by delivery state.", labels=["state"])
        with session_scope(self.database_url) as session:
            for state, kind, count in session.execute(
                select(Job.state, Job.kind, func.count()).group_by(Job.state, Job.kind)
            ):
                jobs.add_metric([state, kind], count)
            waiting = Job.state.in_([s.value for s in WAITING])
            for queue, first in session.execute(
                select(Job.queue, func.min(Job.created_at)).where(waiting).group_by(Job.queue)
            ):
                oldest.add_metric([queue], _age(now, first))
            held = dict(session.execute(select(Lease.host, func.count()).group_by(Lease.host)).tuples().all())
            for host in session.scalars(select(Host).order_by(Host.name)):
                leases.add_metric([host.name], held.get(host.name, 0))
                devices.add_metric([host.name, host.device_type], len(host.device_ids or range(host.devices)))
                heartbeat.add_metric([host.name], _age(now, host.heartbeat_at))
            newest = (
                select(MetricPoint.job_id, func.max(MetricPoint.time).label("newest"))
                .group_by(MetricPoint.job_id)
                .subquery()
            )
            rows = (
                session.execute(
                    select(Job.heartbeat_at, newest.c.newest)
                    .join(newest, newest.c.job_id == Job.id)
                    .where(Job.state == JobState.running.value)
                )
                .tuples()
                .all()
            )
            lag.add_metric([], max((_age(stored, written) for stored, written in rows if stored), default=0.0))
            for state, count in session.execute(
                select(WebhookDelivery.state, func.count()).group_by(WebhookDelivery.state)
            ):
                hooks.add_metric([state], count)
        yield from (jobs, oldest, leases, devices, heartbeat, lag, hooks)


class ServiceMetrics:
    """The process's registry: request histograms plus the database collector."""

    def __init__(self, database_url: str):
        self.registry = CollectorRegistry()
        self.requests = Histogram(
            "llmjobs_http_request_duration_seconds",
            "HTTP request latency by route template.",
            labelnames=["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(ServiceCollector(database_url))

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).observe(seconds)

    def exposition(self) -> bytes:
        """The text format a scrape receives."""
        return generate_latest(self.registry)
