"""A worker's presence: a second signal, besides its heartbeat, that says within seconds whether it still lives.

On PostgreSQL each worker holds a session advisory lock (``PresenceLock``) on a connection of its own, outside the
pool, with TCP keepalives short enough that the server ends the session within seconds of the host vanishing. A
worker SIGKILLed (or its host gone) loses its session and the lock with it; ``absent_hosts`` reads the held locks from
``pg_locks`` in one query. A CPU-starved worker, API or database keeps its session: presence never confuses slowness
with death, as a heartbeat's age can. Without PostgreSQL (one machine: the embedded setup) presence is the worker's
pid on this machine.

A host records how its presence is to be read in ``hosts.info["presence"]`` (``"session"`` or ``"pid"``), so a host
registered by an older worker, which holds no lock, is never judged absent for lacking one.
"""

from __future__ import annotations

import logging
import platform
import zlib
from collections.abc import Iterable

import psutil
from sqlalchemy import text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.orm import Session

from core.db import get_engine
from core.models import Host

log = logging.getLogger(__name__)
PRESENCE_KEY = "presence"
NAMESPACE = zlib.crc32(b"llmjobs.host") & 0x7FFFFFFF  # the advisory lock's first key: every worker's lock
# The server ends a vanished client's session after ~idle + interval x count seconds (kernel keepalives: a starved
# but living host still answers them).
KEEPALIVE = {"tcp_keepalives_idle": 3, "tcp_keepalives_interval": 1, "tcp_keepalives_count": 3}


def host_key(name: str) -> int:
    """The advisory lock's second key for host ``name`` (31 bits: ``pg_locks.objid`` shows it as is)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def is_postgres(url: str) -> bool:
    return make_url(url).get_backend_name() == "postgresql"


class PresenceLock:
    """The worker side: ``hold()`` takes (or checks) the host's lock; call it before each heartbeat. Not
    thread-safe: one heartbeat thread calls it."""

    def __init__(self, database_url: str, host: str):
        self.url, self.host = database_url, host
        self._conn: Connection | None = None

    def hold(self) -> bool:
        """Whether this process holds the host's lock now (taking it if free). False while another session holds
        it (a previous worker of this host still finishing) or the database is away; the next call tries again."""
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1"))
                return True
            except Exception as err:  # noqa: BLE001 - the session (and the lock) is gone: take it again
                log.warning("presence of %s: lost its session (%s); taking the lock again", self.host, err)
                self._close()
        try:
            conn = get_engine(self.url).connect().execution_options(isolation_level="AUTOCOMMIT")
        except Exception as err:  # noqa: BLE001 - database away: the heartbeat fails too, next beat retries
            log.debug("presence of %s: no connection: %s", self.host, err)
            return False
        try:
            for name, value in KEEPALIVE.items():
                conn.execute(text("SELECT set_config(:name, :value, false)"), {"name": name, "value": str(value)})
            took = conn.execute(
                text("SELECT pg_try_advisory_lock(:ns, :key)"), {"ns": NAMESPACE, "key": host_key(self.host)}
            ).scalar()
            if took:
                conn.execute(
                    text("SELECT set_config('application_name', :name, false)"),
                    {"name": f"llmjobs-worker:{self.host}"[:63]},
                )
        except Exception as err:  # noqa: BLE001
            log.debug("presence of %s: lock attempt failed: %s", self.host, err)
            took = False
        if not took:
            conn.close()
            return False
        conn.detach()  # the lock lives as long as this session: never hand it back to the pool
        self._conn = conn
        return True

    def release(self) -> None:
        """Give the lock up (a clean stop: the host is marked down by its goodbye anyway)."""
        if self._conn is not None:
            try:
                self._conn.execute(
                    text("SELECT pg_advisory_unlock(:ns, :key)"), {"ns": NAMESPACE, "key": host_key(self.host)}
                )
            except Exception as err:  # noqa: BLE001 - the session's end frees it anyway
                log.debug("presence of %s: unlock failed: %s", self.host, err)
            self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        try:
            if conn is not None:
                conn.invalidate()
                conn.close()
        except Exception as err:  # noqa: BLE001 - already broken
            log.debug("presence of %s: closing: %s", self.host, err)


def presence_kind(by_lock: bool) -> dict[str, str]:
    """What a worker records in ``hosts.info`` at registration: how its presence is read."""
    if by_lock:
        return {PRESENCE_KEY: "session"}
    return {PRESENCE_KEY: "pid", "node": platform.node()}


def absent_hosts(session: Session, hosts: Iterable[Host]) -> set[str]:
    """The names of ``hosts`` whose worker is provably gone: its presence lock is free (PostgreSQL), or it recorded a
    pid on this machine that no longer runs. Hosts with no presence recorded are never absent."""
    hosts = list(hosts)
    absent: set[str] = set()
    by_session = [h for h in hosts if (h.info or {}).get(PRESENCE_KEY) == "session"]
    if by_session and session.get_bind().dialect.name == "postgresql":
        held = set(
            session.scalars(
                text(
                    "SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND classid::bigint = :ns AND objsubid = 2"
                ),
                {"ns": NAMESPACE},
            )
        )
        absent.update(h.name for h in by_session if host_key(h.name) not in held)
    here = platform.node()
    for host in hosts:
        info = host.info or {}
        if info.get(PRESENCE_KEY) == "pid" and info.get("node") == here and host.pid and not _running(host.pid):
            absent.add(host.name)
    return absent


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
