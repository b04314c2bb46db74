"""Judging hosts: which up hosts go down, and when the control plane may trust what it sees.

Two signals, two rules:

- **absent** (seconds): a host whose heartbeat is older than ``host_absent_after_s`` and whose worker's presence is
  gone (``core.host_presence``: its database session ended, or its pid on this machine) goes down at once.
- **stale** (``host_stale_after_s``): a host silent that long goes down only if the control plane has been keeping
  up (``ServiceWatch``: its own passes ran on time for ``host_stale_after_s``), the fleet's heartbeats arrive on time
  (most hosts' beats are fresh: a fleet-wide lag is the service's or the network's, not the hosts'), and its worker is
  not provably present (a host holding its presence lock is judged by age only past ``PRESENT_STALE_FACTOR`` times
  ``host_stale_after_s``: a starved worker keeps its session).

A host that said goodbye (its worker marked it down on a clean stop) settles its own running nodes
(``worker_stopped``); its nodes left active are lost here once ``host_absent_after_s + cancel_grace_s`` passed.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.db import session_scope
from core.host_presence import PRESENCE_KEY, absent_hosts
from core.models import Host, JobNode, utcnow
from core.nodes import move_nodes
from core.settings import Settings
from core.states import NODE_ACTIVE, HostState, NodeState, sources

log = logging.getLogger(__name__)
PRESENT_STALE_FACTOR = 10


def absent_after_s(settings: Settings) -> float:
    """``host_absent_after_s``, never less than one heartbeat interval and a second (a beat in flight)."""
    return max(settings.host_absent_after_s, settings.heartbeat_interval_s + 1.0)


def presence_grace_s(settings: Settings) -> float:
    """How long the control plane must have watched before absent verdicts: every live worker has beaten and taken
    its presence lock again since (a database restart ends every session at once)."""
    return absent_after_s(settings) + settings.heartbeat_interval_s


class ServiceWatch:
    """Whether this process has been keeping up: ``tick()`` at the start and end of each pass; a gap longer than
    ``max_gap_s`` between ticks (a frozen event loop, a starved process, a pass that took long) or a fleet-wide
    heartbeat lag (``behind()``) starts the watch over. Verdicts by heartbeat age wait for ``kept_up_for()``."""

    def __init__(self, max_gap_s: float, clock: object = time.monotonic):
        self.max_gap_s = max_gap_s
        self._clock = clock
        self._last: float | None = None
        self._since: float | None = None
        self.gaps = 0  # how many times the watch started over (for the bench and logs)

    def _now(self) -> float:
        return float(self._clock())  # type: ignore[operator]

    def tick(self) -> None:
        now = self._now()
        if self._last is None or now - self._last > self.max_gap_s:
            if self._last is not None:
                self.gaps += 1
                log.warning(
                    "control plane fell behind (%.1f s between its passes); host verdicts wait", now - self._last
                )
            self._since = now
        self._last = now

    def behind(self) -> None:
        self._since = self._now()

    def kept_up_for(self) -> float:
        return 0.0 if self._since is None else self._now() - self._since


@dataclass
class Verdicts:
    ended: list[tuple[str, int, str]] = field(default_factory=list)  # (job, attempt, message): attempts to end
    down: list[str] = field(default_factory=list)
    heartbeat_lag_s: float = 0.0  # the median up host's heartbeat age
    behind: bool = False  # the fleet's heartbeats arrive late: no stale verdict this pass


def mark_host_down(session: Session, host: Host) -> bool:
    """up -> down, unless a heartbeat arrived since ``host`` was read (compare-and-set on state and heartbeat)."""
    moved = session.execute(
        update(Host)
        .where(Host.name == host.name, Host.state.in_(sources(HostState.down)), Host.heartbeat_at == host.heartbeat_at)
        .values(state=HostState.down.value)
        .execution_options(synchronize_session=False)
    )
    return moved.rowcount == 1  # type: ignore[attr-defined]


def fleet_behind(settings: Settings, ages: list[float]) -> bool:
    """More than half of three or more up hosts beat late: the service (its database, its network) is behind, not
    the hosts (Kubernetes stops evicting from a fully disrupted zone for the same reason)."""
    return len(ages) >= 3 and statistics.median_low(ages) > 2 * settings.heartbeat_interval_s + 1.0


def judge_hosts(settings: Settings, *, stale_ok: bool = True, absent_ok: bool = True) -> Verdicts:
    """One pass over the up hosts (see the module's rules); the nodes of down hosts are lost. Commits."""
    out = Verdicts()
    now = utcnow()
    with session_scope(settings.database_url) as session:
        # every up host's age from two columns; whole rows (their info, read for the presence rules) only of the
        # silent few: at 1,000 hosts, building 1,000 ORM rows with their JSON was most of this pass
        beats = session.execute(select(Host.name, Host.heartbeat_at).where(Host.state == HostState.up.value)).all()
        ages = {name: (now - beat).total_seconds() for name, beat in beats}
        out.heartbeat_lag_s = statistics.median_low(ages.values()) if ages else 0.0
        out.behind = fleet_behind(settings, list(ages.values()))
        quiet = sorted(name for name, age in ages.items() if age > absent_after_s(settings))
        rows = [
            h
            for i in range(0, len(quiet), 500)
            for h in session.scalars(select(Host).where(Host.name.in_(quiet[i : i + 500])))
        ]
        for host in rows:  # as read now: a beat since the first read counts (the verdict compares this heartbeat)
            ages[host.name] = (now - host.heartbeat_at).total_seconds()
        silent = [h for h in rows if h.state == HostState.up.value and ages[h.name] > absent_after_s(settings)]
        absent = absent_hosts(session, silent) if silent and absent_ok else set()
        present = _present(session, silent, absent)
        for host in silent:
            age = ages[host.name]
            limit = settings.host_stale_after_s * (PRESENT_STALE_FACTOR if host.name in present else 1)
            stale = stale_ok and not out.behind and age > limit
            if (host.name in absent or stale) and mark_host_down(session, host):
                why = "its worker is gone (presence lost)" if host.name in absent else "stopped heart-beating"
                log.warning("host %s: %s (last heartbeat %.1f s ago); marked down", host.name, why, age)
                out.down.append(host.name)
        if out.behind and any(ages[h.name] > settings.host_stale_after_s for h in silent):
            log.warning(
                "heartbeats arrive late across the fleet (median %.1f s): no host judged stale", out.heartbeat_lag_s
            )
        out.ended = _lose_nodes(session, settings, out.down, now)
    return out


def _present(session: Session, hosts: list[Host], absent: set[str]) -> set[str]:
    """Hosts whose worker holds its presence lock now (read from the same ``pg_locks`` answer)."""
    if session.get_bind().dialect.name != "postgresql":
        return set()
    return {h.name for h in hosts if (h.info or {}).get(PRESENCE_KEY) == "session" and h.name not in absent}


def _lose_nodes(session: Session, settings: Settings, downed: list[str], now: datetime) -> list[tuple[str, int, str]]:
    """Active nodes of hosts down now (judged in this pass) or down for longer than a goodbye takes to settle its own."""
    settled_by = now - timedelta(seconds=absent_after_s(settings) + settings.cancel_grace_s)
    down = select(Host.name).where(
        Host.state == HostState.down.value, (Host.heartbeat_at < settled_by) | Host.name.in_(downed or [""])
    )
    active = [s.value for s in NODE_ACTIVE]
    ended = []
    for node in list(session.scalars(select(JobNode).where(JobNode.host.in_(down), JobNode.state.in_(active)))):
        reason = f"host {node.host} stopped heart-beating"
        if move_nodes(session, NodeState.lost, JobNode.id == node.id, finished_at=utcnow(), reason=reason):
            ended.append((node.job_id, node.attempt, f"node {node.node_rank} lost: {reason}"))
    session.commit()
    return ended
