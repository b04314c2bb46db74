"""Celery tasks: thin, like views. They take ids and hand off to ``core.scheduler`` / ``worker.node``."""

from __future__ import annotations

from core.scheduler import schedule
from core.settings import get_settings
from core.messaging import celery_app
from worker.node import run_node as run_node_on_host


@celery_app.task(name="llmjobs.run_job")
def run_job(job_id: str) -> str:
    """"Job X waits": run a scheduling pass here, which leases devices for it (on any host) if they are free and
    sends each node's ``run_node`` message to its host's queue. A duplicate or stale message does nothing more."""
    granted = schedule(get_settings())
    return "scheduled" if any(g.job_id == job_id for g in granted) else "waiting"


@celery_app.task(name="llmjobs.run_node")
def run_node(job_id: str, attempt: int, node_rank: int) -> str:
    """Run node ``node_rank`` of attempt ``attempt`` on this host; a redelivered message finds it claimed and returns."""
    settings = get_settings()
    return run_node_on_host(settings, job_id, attempt, node_rank, host=settings.worker_name)
