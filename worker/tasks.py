"""Celery tasks: thin, like views. They take an id and hand off to ``worker.execute``."""

from __future__ import annotations

from app.settings import get_settings
from worker.celery_app import celery_app
from worker.execute import execute_job


@celery_app.task(name="llmjobs.run_job")
def run_job(job_id: str) -> str:
    """Run job ``job_id`` if it is still waiting; a duplicate or stale message does nothing."""
    settings = get_settings()
    return execute_job(settings, job_id, host=settings.worker_name)
