"""No live host judged dead when the control plane starves: heartbeats that arrive late only because the service (its
passes), the database or the fleet's path to it fell behind never turn into failovers; a host that really stopped is
judged down once the service has caught up.

A fleet of simulated hosts (no presence lock, as an older worker's: judged by heartbeat age alone) beats in one
statement a round (``worker.hosts.beat_many``); the leader's host pass (``core.reconciler.watch_hosts`` with its
``ServiceWatch``) runs in a thread, every ``presence_interval_s``, on PostgreSQL."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import select

from core.db import session_scope
from core.models import Host
from core.reconciler import service_watch, watch_hosts
from core.settings import Settings
from core_support import fresh_postgres_database, isolated_settings
from worker.hosts import beat_many, register_host

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
HOSTS = [f"h{i:02d}" for i in range(12)]
STARVED_S = 6.0  # twice host_stale_after_s: every heartbeat stale by 3 s (three times: 9 s a phase, 27 s of the 48)


@pytest.fixture
def pg_url(postgres_url: str) -> Iterator[str]:
    with fresh_postgres_database(postgres_url, migrated=True) as url:
        yield url


class Loop(threading.Thread):
    """``step`` every ``interval`` s while not paused (a paused loop is a frozen process: it does nothing at all)."""

    def __init__(self, interval: float, step: object):
        super().__init__(daemon=True)
        self.interval, self.step = interval, step
        self.running, self.stopped = threading.Event(), threading.Event()
        self.running.set()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.running.wait()
            try:
                self.step()  # type: ignore[operator]
            except Exception as err:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(err))


def down_hosts(settings: Settings) -> list[str]:
    with session_scope(settings.database_url) as session:
        return list(session.scalars(select(Host.name).where(Host.state == "down").order_by(Host.name)))


@contextlib.contextmanager
def fleet(settings: Settings, judged: list[str]) -> Iterator[tuple[Loop, Loop, list[str]]]:
    """The hosts beating and the service judging them; ``judged`` collects every verdict (a live host's next beat
    would bring it back up, but its nodes would be lost by then)."""
    for name in HOSTS:
        register_host(settings, name=name, device_type="cpu", devices=1, queues=["q"])
    beating = list(HOSTS)
    beats = Loop(settings.heartbeat_interval_s, lambda: beat_many(settings, beating))
    watch = service_watch(settings)
    service = Loop(settings.presence_interval_s, lambda: judged.extend(watch_hosts(settings, watch).down))
    beats.start()
    service.start()
    try:
        yield beats, service, beating
    finally:
        for loop in (beats, service):
            loop.running.set()
            loop.stopped.set()
            loop.join()
    assert beats.errors == [] and service.errors == []


def test_starved_service_judges_no_live_host_down_then_a_stopped_one(tmp_path: Path, pg_url: str) -> None:
    settings = isolated_settings(
        tmp_path, pg_url, heartbeat_interval_s=0.5, host_stale_after_s=3, presence_interval_s=0.25
    )
    judged: list[str] = []
    with fleet(settings, judged) as (beats, service, beating):
        time.sleep(settings.host_stale_after_s + 1)  # the service has watched long enough to judge

        # 1. The whole machine starved: the service's passes and the hosts' heartbeats frozen together.
        service.running.clear()
        beats.running.clear()
        time.sleep(STARVED_S)
        service.running.set()  # the service first: it sees every heartbeat STARVED_S old
        time.sleep(1.0)
        beats.running.set()
        time.sleep(settings.host_stale_after_s + 1)
        assert judged == []

        # 2. The heartbeats alone late (the hosts' path to the database): the fleet's lag is the service's.
        beats.running.clear()
        time.sleep(STARVED_S)
        beats.running.set()
        time.sleep(settings.host_stale_after_s + 1)
        assert judged == []

        # 3. The database stalled: heartbeats and the service's reads wait on the hosts table together.
        engine = sa.create_engine(pg_url)
        with engine.begin() as conn:
            conn.execute(sa.text("LOCK TABLE hosts IN ACCESS EXCLUSIVE MODE"))
            time.sleep(STARVED_S)
        engine.dispose()
        time.sleep(settings.host_stale_after_s + 1)
        assert judged == []

        # 4. One host really stops: judged down once host_stale_after_s passed with the service keeping up.
        beating.remove("h00")
        stopped = time.monotonic()
        deadline = stopped + 4 * settings.host_stale_after_s
        while not judged and time.monotonic() < deadline:
            time.sleep(0.2)
        took = time.monotonic() - stopped
    assert judged == ["h00"] and down_hosts(settings) == ["h00"]
    assert settings.host_stale_after_s <= took <= 2 * settings.host_stale_after_s + 1, took
