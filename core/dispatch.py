"""Dispatch a committed job: a scheduling pass right away, else the "job X waits" message that wakes a worker."""

from __future__ import annotations

import logging

from sqlalchemy import update

from core.db import session_scope
from core.messaging import send_schedule
from core.models import Job, utcnow
from core.scheduler import schedule
from core.settings import Settings

log = logging.getLogger(__name__)


def dispatch(settings: Settings, job_id: str, queue: str) -> bool:
    """Run a scheduling pass (it leases devices for the committed job if they are free and messages its hosts);
    if the job still waits, send the "job X waits" message that wakes the workers' schedulers. False if the
    broker refused."""
    try:
        if any(g.job_id == job_id for g in schedule(settings)):
            return True
    except Exception as err:  # noqa: BLE001 - the reconciler and the workers schedule again
        log.warning("scheduling pass for %s failed (will be retried): %s", job_id, err)
    try:
        send_schedule(settings, job_id, queue)
    except Exception as err:  # noqa: BLE001 - the reconciler retries
        log.warning("dispatch of %s failed (the reconciler will retry): %s", job_id, err)
        return False
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).where(Job.id == job_id).values(dispatched_at=utcnow()))
    return True
