"""A worker host registers itself in the hosts table and heart-beats while it runs (leases build on this)."""

from __future__ import annotations

import logging
import os
import platform
import threading
from collections.abc import Callable

from sqlalchemy import update

from core.db import session_scope
from core.host_presence import PresenceLock
from core.models import Host, utcnow
from core.settings import Settings
from core.states import HostState
from engine.contract.plan.planner import DEVICE_MEMORY_KEY, HOST_MEMORY_KEY

log = logging.getLogger(__name__)


def register_host(
    settings: Settings,
    *,
    name: str,
    device_type: str,
    devices: int,
    queues: list[str],
    device_ids: list[int] | None = None,
    address: str | None = None,
    device_memory: int | None = None,
    host_memory: int | None = None,
    presence: dict[str, str] | None = None,
) -> None:
    """Insert or refresh the host's row, up; ``presence`` (``core.host_presence.presence_kind``) says how the
    control plane may tell, within seconds, that this worker is gone."""
    with session_scope(settings.database_url) as session:
        host = session.get(Host, name) or Host(name=name)
        host.device_type, host.devices, host.queue = device_type, devices, ",".join(queues)
        host.device_ids, host.address = device_ids, address
        host.pid, host.state, host.started_at, host.heartbeat_at = os.getpid(), HostState.up.value, utcnow(), utcnow()
        host.info = {"platform": platform.platform(), "python": platform.python_version(), "node": platform.node()}
        if device_memory:  # read by the API's memory check at submission
            host.info[DEVICE_MEMORY_KEY] = device_memory
        if host_memory:  # the host's RAM: an offloaded optimizer state (optimizer_cpu_offload) must fit it
            host.info[HOST_MEMORY_KEY] = host_memory
        host.info.update(presence or {})
        session.add(host)


def set_host_state(settings: Settings, name: str, state: HostState, pid: int | None = None) -> bool:
    """Stamp ``state`` and a heartbeat; with ``pid``, only while that process is the host's registered worker (a
    worker replaced by a newer one on the same host, still finishing after a restart, must neither mark the host
    down nor keep it alive). Returns whether it stamped."""
    where = [Host.name == name] + ([Host.pid == pid] if pid is not None else [])
    with session_scope(settings.database_url) as session:  # one statement: no read first, no row held longer
        stamped = session.execute(
            update(Host)
            .where(*where)
            .values(state=state.value, heartbeat_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        return bool(stamped.rowcount)  # type: ignore[attr-defined]


def beat_many(settings: Settings, names: list[str]) -> int:
    """Heartbeats of several hosts in one statement (a simulated fleet, an agent serving many hosts): up, now."""
    if not names:
        return 0
    with session_scope(settings.database_url) as session:
        stamped = session.execute(
            update(Host)
            .where(Host.name.in_(names))
            .values(state=HostState.up.value, heartbeat_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        return int(stamped.rowcount)  # type: ignore[attr-defined]


class HostHeartbeat(threading.Thread):
    """Stamps ``hosts.heartbeat_at`` every ``heartbeat_interval_s`` until stopped."""

    def __init__(
        self,
        settings: Settings,
        name: str,
        on_beat: Callable[[], object] | None = None,
        stopping: threading.Event | None = None,
        presence: PresenceLock | None = None,
    ):
        super().__init__(name=f"heartbeat-{name}", daemon=True)
        self.settings, self.host, self.on_beat, self.stopping = settings, name, on_beat, stopping
        self.pid = os.getpid()  # the worker that registered the host (register_host stores its pid)
        self.presence = presence  # held before each beat: taken again after a lost session
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.settings.heartbeat_interval_s):
            if self.stopping is not None and self.stopping.is_set():
                return  # the worker shuts down and has marked its host down: beating would bring it back up
            try:
                if self.presence is not None:
                    self.presence.hold()  # before the stamp: a fresh heartbeat always comes with the lock held
                if not set_host_state(self.settings, self.host, HostState.up, pid=self.pid):
                    log.warning("host %s: another worker registered it since; this one no longer beats", self.host)
                    continue  # its housekeeping (the lease sweep) would judge the new worker's nodes as orphans
                if self.on_beat is not None:
                    self.on_beat()  # housekeeping: parked exits (worker.node.finish_parked), the lease sweep, a scheduling pass
            except Exception as err:  # noqa: BLE001 - a database blip must not kill the heartbeat
                log.warning("host heartbeat failed: %s", err)

    def stop(self) -> None:
        self._stop_event.set()
        if self.presence is not None:
            self.presence.release()
