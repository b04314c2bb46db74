"""Celery configuration only. The job row in the database, not the message, decides whether work runs."""

from __future__ import annotations

from functools import lru_cache

from celery import Celery

from core.settings import get_settings


def transport_options(broker_url: str) -> dict[str, object]:
    if broker_url.startswith("sqla+"):
        return {}  # kombu hands these to create_engine(); polling is set on the consumer
    # Redis redelivers unacked messages after this; a redelivered run_job finds its job taken and returns.
    return {"visibility_timeout": 12 * 3600}


@lru_cache(maxsize=4)
def get_celery(broker_url: str) -> Celery:
    app = Celery("llmjobs", broker=broker_url, include=["worker.tasks"])
    app.conf.update(
        task_acks_late=True,  # a message is only gone once its job has been handled ...
        task_reject_on_worker_lost=True,  # ... and a crashed worker's message goes back to the queue
        worker_prefetch_multiplier=1,  # a long job must not sit on a second message
        task_ignore_result=True,  # results live in the jobs table
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        broker_pool_limit=4,
        broker_transport_options=transport_options(broker_url),
    )
    return app


celery_app = get_celery(get_settings().broker_url)
