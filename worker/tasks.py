"""Celery tasks: thin, like views. They take ids and hand off to ``core.scheduler`` / ``worker.node``.

The names come from ``core.messaging``; the schedule task is registered under its old names too, so messages
queued before an upgrade still run.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_shutting_down

from core.messaging import LEGACY_TASK_NAMES, RUN_NODE_TASK, SCHEDULE_TASK, get_celery
from core.scheduler import schedule
from core.settings import get_settings
from core.structured_logs import HEADER, bound
from worker import broker_compat
from worker.node import run_node as run_node_on_host
from worker.node import shut_down

log = logging.getLogger(__name__)
celery_app = get_celery(get_settings().broker_url)
broker_compat.install()  # a lost Redis connection must not end the worker (see worker.broker_compat)


def message_request_id() -> str | None:
    """The submitting request's id from the message being handled (``core.messaging`` puts it in a header)."""
    task = celery_app.current_task
    if task is None:
        return None
    # A worker merges message headers into the request; an eager apply() keeps them under "headers".
    return task.request.get(HEADER) or (task.request.get("headers") or {}).get(HEADER)


def schedule_for(job_id: str) -> str:
    """ "Job X waits": run a scheduling pass here, which leases devices for it (on any host) if they are free and
    sends each node's ``run_node`` message to its host's queue. A duplicate or stale message does nothing more."""
    with bound(request_id=message_request_id(), job_id=job_id):
        granted = schedule(get_settings())
        return "scheduled" if any(g.job_id == job_id for g in granted) else "waiting"


def run_node(job_id: str, attempt: int, node_rank: int) -> str:
    """Run node ``node_rank`` of attempt ``attempt`` on this host; a redelivered message finds it claimed and returns."""
    settings = get_settings()
    with bound(request_id=message_request_id(), job_id=job_id):
        log.info("node %s of attempt %s: message received", node_rank, attempt)
        return run_node_on_host(settings, job_id, attempt, node_rank, host=settings.worker_name)


BODIES = {SCHEDULE_TASK: schedule_for, RUN_NODE_TASK: run_node}
for name, body in {**BODIES, **{old: BODIES[new] for old, new in LEGACY_TASK_NAMES.items()}}.items():
    celery_app.task(name=name)(body)


@worker_shutting_down.connect
def _stop_engines_on_shutdown(**_: Any) -> None:
    """Warm shutdown waits for running tasks; their engines must not train on with no service (issue 27). The host
    is marked down first, so no scheduling pass grants it the retries (the next worker on it registers it up)."""
    settings = get_settings()
    shut_down(settings, settings.worker_name)
