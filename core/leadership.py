"""Leadership among API replicas: the singleton loops (reconciler with recovery and pipeline advancing, webhook
sender, retention) run in one process at a time.

On PostgreSQL the leader holds a session-level advisory lock (``pg_try_advisory_lock``) on a connection of its own,
outside the pool. If the leader dies (SIGKILL, host gone) the server ends its session and frees the lock; every
other replica tries to take it on each tick of its loops, so one of them leads within a loop interval. A leader
checks its connection on every tick and steps down when it is gone (the lock went with it). On SQLite the service
is one API process, which always leads.

Scheduling passes need no leader: they serialise on the ``scheduler_lock`` row (``core.scheduler``), so the
replica that took a submission runs the pass for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import anyio
from sqlalchemy import text
from sqlalchemy.engine import Connection, make_url

from core.db import get_engine

log = logging.getLogger(__name__)
LOCK_NAME = "llmjobs.leader"


def leader_name() -> str:
    """The leader's session shows as this ``application_name`` in pg_stat_activity (which process leads)."""
    return f"llmjobs-leader:{socket.gethostname()}:{os.getpid()}"


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for ``name`` (the same in every replica)."""
    return zlib.crc32(name.encode())


class Leadership:
    """``is_leader()`` answers, and on PostgreSQL tries to become, the leader. Thread-safe."""

    def __init__(self, database_url: str, name: str = LOCK_NAME):
        self.url, self.key = database_url, lock_key(name)
        self.postgres = make_url(database_url).get_backend_name() == "postgresql"
        self._conn: Connection | None = None
        self._mutex = threading.Lock()
        self._since: float | None = None  # monotonic time this process took the lock (PostgreSQL)

    def is_leader(self) -> bool:
        if not self.postgres:
            return True
        with self._mutex:
            if self._conn is not None and not self._alive():
                self._drop("lost its database session")
            if self._conn is None:
                self._try_take()
            return self._conn is not None

    def led_for(self) -> float:
        """Seconds this process has led without a break (0 when it does not lead; unbounded on SQLite, which has
        one process and no lock to lose). The reconciler judges hosts by their heartbeats only after it has led
        for ``host_stale_after_s``: a new leader, or one back from a database outage, first lets every live host
        beat again (during the outage none could), instead of taking them all for dead."""
        if not self.postgres:
            return float("inf")
        since = self._since
        return 0.0 if since is None else time.monotonic() - since

    def _alive(self) -> bool:
        assert self._conn is not None
        try:
            self._conn.execute(text("SELECT 1"))
            self._conn.commit()
            return True
        except Exception:  # noqa: BLE001 - any failure means the session (and the lock) may be gone
            return False

    def _try_take(self) -> None:
        try:
            conn = get_engine(self.url).connect().execution_options(isolation_level="AUTOCOMMIT")
        except Exception as err:  # noqa: BLE001 - database away: not the leader now, try next tick
            log.debug("leadership: no connection: %s", err)
            return
        try:
            won = bool(conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": self.key}).scalar())
        except Exception as err:  # noqa: BLE001
            log.debug("leadership: lock attempt failed: %s", err)
            won = False
        if not won:
            conn.close()
            return
        conn.detach()  # the lock lives as long as this session: never hand it back to the pool
        conn.execute(text("SELECT set_config('application_name', :name, false)"), {"name": leader_name()})
        self._conn, self._since = conn, time.monotonic()
        log.info("leadership: this process now runs the singleton loops")

    def _drop(self, why: str) -> None:
        log.warning("leadership: stepping down (%s)", why)
        conn, self._conn, self._since = self._conn, None, None
        try:
            if conn is not None:
                conn.invalidate()
                conn.close()
        except Exception as err:  # noqa: BLE001 - already broken
            log.debug("leadership: closing the lost session: %s", err)

    def release(self) -> None:
        """Give the lock up (on shutdown) so another replica leads at once."""
        with self._mutex:
            conn, self._conn, self._since = self._conn, None, None
        if conn is not None:
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": self.key})
                conn.close()
            except Exception as err:  # noqa: BLE001 - the session end frees it anyway
                log.debug("leadership: unlock failed: %s", err)


async def run_when_leader(leader: Leadership, interval_s: float, tick: Callable[[], Any], what: str) -> None:
    """Call ``tick`` in a thread every ``interval_s`` while this process leads; a failed tick is logged, not fatal."""
    while True:
        try:
            if await anyio.to_thread.run_sync(leader.is_leader):
                await anyio.to_thread.run_sync(tick)
        except Exception as err:  # noqa: BLE001 - keep the loop alive across database blips
            log.warning("%s failed: %s", what, err)
        await asyncio.sleep(interval_s)
