"""A worker's start-up and shutdown on one host: discover its devices, register them, recover what a previous worker
on this host left, heart-beat, and consume the host's queues until stopped (Celery's thread pool: one thread per
leased node, plus one for scheduling passes). ``llmjobs worker`` parses its options and calls ``run_worker``."""

from __future__ import annotations

import os

from core import structured_logs
from core.gc_tuning import settle_heap
from core.host_presence import PresenceLock, is_postgres, presence_kind
from core.messaging import declare_queues, host_queue
from core.scheduler import schedule
from core.settings import Settings, use_settings
from core.states import HostState
from worker.devices import Inventory, device_memory_bytes, discover, host_address, host_memory_bytes
from worker.hosts import HostHeartbeat, register_host, set_host_state
from worker.leases import sweep_host
from worker.node import STOPPING, finish_parked


def inventory(settings: Settings, device_type: str, devices: int | None) -> Inventory:
    """This host's devices: ``devices`` when given, else ``LLMJOBS_WORKER_DEVICES`` when set, else discovered.
    ``ValueError``/``RuntimeError`` for a device type the host lacks."""
    configured = devices if devices is not None else None
    if configured is None and "worker_devices" in settings.model_fields_set:
        configured = settings.worker_devices
    return discover(device_type, configured)


def presence_lock(settings: Settings) -> PresenceLock | None:
    """The worker's presence lock (PostgreSQL, unless ``worker_presence_lock`` is off), taken before it registers."""
    if not settings.worker_presence_lock or not is_postgres(settings.database_url):
        return None
    lock = PresenceLock(settings.database_url, settings.worker_name)
    lock.hold()  # a previous worker of this host may still hold it: the heartbeat takes it once that one is gone
    return lock


def _register(settings: Settings, found: Inventory, presence: PresenceLock | None = None) -> list[str]:
    name = settings.worker_name
    queues = [settings.queue_for(found.device_type), host_queue(name)]
    declare_queues(settings, queues)  # before consuming: survives another worker creating them at the same moment
    register_host(
        settings,
        name=name,
        device_type=found.device_type,
        devices=len(found.device_ids),
        queues=queues,
        device_ids=found.device_ids,
        address=host_address(settings.worker_address),
        device_memory=device_memory_bytes(found.device_type, len(found.device_ids)),
        host_memory=host_memory_bytes() or None,
        presence=presence_kind(by_lock=presence is not None),
    )
    finish_parked(settings, name)  # exits a previous worker parked while the database was away: store them
    sweep_host(settings, name)  # what a previous worker on this host left: kill it, mark it lost, free the devices
    return queues


def run_worker(settings: Settings, found: Inventory) -> None:
    """Serve this host until the Celery worker stops; the host is marked down on the way out (unless a newer worker
    took it over)."""
    use_settings(settings)  # the task module (worker.tasks) reads the same settings
    structured_logs.configure(settings.log_level, settings.log_format == "json")
    name = settings.worker_name
    presence = presence_lock(settings)
    queues = _register(settings, found, presence)
    schedule(settings)
    beat = HostHeartbeat(
        settings,
        name,
        on_beat=lambda: (
            finish_parked(settings, name),
            sweep_host(settings, name),
            schedule(settings, backstop=True),
        ),
        stopping=STOPPING,
        presence=presence,
    )
    beat.start()
    threads = max(settings.worker_concurrency, len(found.device_ids) + 1)  # a thread per leased node, + a pass
    from worker.tasks import celery_app  # builds the Celery app from the settings pinned above

    argv = ["worker", "-Q", ",".join(queues), "-n", f"{name}@%h", "--pool", "threads", "-c", str(threads)]
    settle_heap()  # the started worker out of the collector's reach: no full collection inside a scheduling pass
    try:
        celery_app.worker_main([*argv, "--loglevel", "INFO", "--without-gossip", "--without-mingle"])
    finally:
        beat.stop()
        set_host_state(settings, name, HostState.down, pid=os.getpid())
