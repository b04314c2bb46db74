"""Dispatch committed jobs: a scheduling pass, then the "job X waits" message for each job still waiting.

Submissions do not schedule inside the request: ``POST /v1/jobs`` commits the job and wakes the ``Dispatcher`` of its
process, whose loop runs one pass for every submission since the last (passes serialise on the ``scheduler_lock`` row,
so many submissions must not each wait for one). A job is dispatched once: its ``dispatched_at`` is claimed by
compare-and-set before its message goes out, so several API replicas never send it twice; the reconciler re-sends
messages that got lost.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio
from sqlalchemy import select, update

from core.db import session_scope
from core.messaging import send_schedule
from core.models import Job, utcnow
from core.scheduler import schedule
from core.settings import Settings
from core.states import WAITING

log = logging.getLogger(__name__)


def _mark(settings: Settings, job_id: str, sent: bool) -> bool:
    """Claim (sent=True: dispatched_at NULL -> now) or release (sent=False: back to NULL) a job's message."""
    with session_scope(settings.database_url) as session:
        where = Job.dispatched_at.is_(None) if sent else Job.dispatched_at.is_not(None)
        moved = session.execute(
            update(Job)
            .where(Job.id == job_id, where)
            .values(dispatched_at=utcnow() if sent else None)
            .execution_options(synchronize_session=False)
        )
        return moved.rowcount == 1  # type: ignore[attr-defined]


def send_waiting(settings: Settings, job_id: str, queue: str) -> bool:
    """Send "job X waits" to ``queue``; False if the broker refused (the reconciler re-sends it)."""
    try:
        send_schedule(settings, job_id, queue)
    except Exception as err:  # noqa: BLE001 - the reconciler retries
        log.warning("dispatch of %s failed (the reconciler will retry): %s", job_id, err)
        return False
    with session_scope(settings.database_url) as session:
        session.execute(update(Job).where(Job.id == job_id).values(dispatched_at=utcnow()))
    return True


def dispatch(settings: Settings, job_id: str, queue: str) -> bool:
    """Run a scheduling pass (it leases devices for the committed job if they are free and messages its hosts);
    if the job still waits, send the "job X waits" message that wakes the workers' schedulers. False if the
    broker refused."""
    try:
        if any(g.job_id == job_id for g in schedule(settings)):
            return True
    except Exception as err:  # noqa: BLE001 - the reconciler and the workers schedule again
        log.warning("scheduling pass for %s failed (will be retried): %s", job_id, err)
    return send_waiting(settings, job_id, queue)


def dispatch_new(settings: Settings) -> int:
    """One scheduling pass, then the message of every waiting job never dispatched yet (claimed first, so a job's
    message leaves one replica only). Returns how many messages were sent."""
    try:
        schedule(settings)  # a granted job has dispatched_at set by its grant
    except Exception as err:  # noqa: BLE001 - the messages below still wake the workers' schedulers
        log.warning("scheduling pass failed (will be retried): %s", err)
    with session_scope(settings.database_url) as session:
        fresh = list(
            session.execute(
                select(Job.id, Job.queue, Job.request_id)
                .where(Job.state.in_([s.value for s in WAITING]), Job.kind != "pipeline", Job.dispatched_at.is_(None))
                .order_by(Job.created_at)
            ).tuples()
        )
    sent = 0
    for job_id, queue, request_id in fresh:
        if not _mark(settings, job_id, sent=True):
            continue  # another replica took it
        try:
            send_schedule(settings, job_id, queue, request_id)
            sent += 1
        except Exception as err:  # noqa: BLE001 - released: the next pass or the reconciler sends it
            log.warning("dispatch of %s failed (will be retried): %s", job_id, err)
            _mark(settings, job_id, sent=False)
    return sent


class Dispatcher:
    """The process's scheduling loop: ``wake()`` after a submission commits; ``run()`` does a ``dispatch_new`` pass
    per wake (wakes that arrive during a pass coalesce into the next), at most one every ``dispatch_min_interval_s``,
    and one every ``reconcile_interval_s`` anyway (jobs submitted through another replica)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._wake: asyncio.Event | None = None

    def start(self) -> asyncio.Task[None]:
        """The loop as a task of the running event loop (an app may be started more than once, as tests do)."""
        self._wake = asyncio.Event()
        return asyncio.create_task(self.run(self._wake))

    def wake(self) -> None:
        """Call on the event loop that runs the loop."""
        if self._wake is not None:
            self._wake.set()

    async def run(self, wake: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(wake.wait(), timeout=self.settings.reconcile_interval_s)
            except TimeoutError:
                pass
            wake.clear()
            started = time.monotonic()
            try:
                await anyio.to_thread.run_sync(dispatch_new, self.settings)
            except Exception as err:  # noqa: BLE001 - keep dispatching after a database blip
                log.warning("dispatch pass failed: %s", err)
            await asyncio.sleep(max(0.0, self.settings.dispatch_min_interval_s - (time.monotonic() - started)))
