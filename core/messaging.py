"""Celery messaging: the broker configuration, every task name, and the only code that sends a message.

The job row in the database, not the message, decides whether work runs: a message only says "look at job X".
Two messages exist:

- ``llmjobs.schedule`` (to a device-type queue): a job waits; a worker that takes it runs a scheduling pass.
  Its old name ``llmjobs.run_job`` is still accepted (``LEGACY_TASK_NAMES``), for messages queued before an upgrade.
- ``llmjobs.run_node`` (to one host's queue): run node ``node_rank`` of attempt ``attempt`` of job X on that host.

The worker registers the task bodies under these names (``worker.tasks``); everything else calls ``send_*`` here.
"""

from __future__ import annotations

import random
import time
from functools import lru_cache

from celery import Celery

from core.settings import Settings
from core.structured_logs import HEADER

SCHEDULE_TASK = "llmjobs.schedule"
RUN_NODE_TASK = "llmjobs.run_node"
LEGACY_TASK_NAMES = {"llmjobs.run_job": SCHEDULE_TASK}  # old name -> the task that now does its work


def host_queue(host: str) -> str:
    """The queue only the worker of ``host`` consumes (its nodes' ``run_node`` messages)."""
    return f"host.{host}"


def transport_options(broker_url: str) -> dict[str, object]:
    if broker_url.startswith("sqla+"):
        return {}  # kombu hands these to create_engine(); polling is set on the consumer
    # Redis redelivers unacked messages after this; a redelivered run_node finds its node taken and returns.
    return {"visibility_timeout": 12 * 3600}


@lru_cache(maxsize=4)
def get_celery(broker_url: str) -> Celery:
    """The Celery app for ``broker_url`` (configuration only: creating it starts no worker and connects nowhere)."""
    app = Celery("llmjobs", broker=broker_url)
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


def declare_queues(settings: Settings, names: list[str], attempts: int = 20) -> None:
    """Create ``names`` on the broker before a worker consumes them. Kombu's SQLAlchemy transport creates its tables
    and queue rows with a check-then-insert that only an in-process lock guards, so two workers starting together
    on the embedded broker race on ``kombu_queue.name`` UNIQUE (or on CREATE TABLE) and the loser dies at start;
    here the loser retries with a fresh connection and finds the row the winner made."""
    app = get_celery(settings.broker_url)
    for name in names:
        for attempt in range(attempts):
            try:
                with app.connection_for_write() as connection:
                    connection.default_channel.queue_declare(queue=name)
                break
            except Exception:  # noqa: BLE001 - IntegrityError/OperationalError of the race: try again
                if attempt == attempts - 1:
                    raise
                time.sleep(0.05 * (attempt + 1) + random.random() * 0.05)


def _headers(request_id: str | None) -> dict[str, str] | None:
    return {HEADER: request_id} if request_id else None  # the submitting request's id (core.structured_logs)


def send_schedule(settings: Settings, job_id: str, queue: str, request_id: str | None = None) -> None:
    """ "Job X waits": wake a worker of ``queue`` to run a scheduling pass. Send only after the job row committed."""
    get_celery(settings.broker_url).send_task(SCHEDULE_TASK, args=[job_id], queue=queue, headers=_headers(request_id))


def waiting_in_queue(settings: Settings, hosts: list[str]) -> set[str] | None:
    """Which of ``hosts`` still have a message waiting in their queue (one pipelined ``LLEN`` per host, one round
    trip), on a Redis broker; None on any other broker (unknown). A node whose host's queue is not empty has not
    lost its message: its worker has not got to it yet, and a copy would only queue behind it."""
    if not settings.broker_url.startswith(("redis://", "rediss://")):
        return None
    import redis

    client = redis.Redis.from_url(settings.broker_url)
    try:
        pipe = client.pipeline(transaction=False)
        for host in hosts:
            pipe.llen(
                host_queue(host)
            )  # kombu's Redis transport keeps a queue's waiting messages in a list of its name
        return {host for host, length in zip(hosts, pipe.execute(), strict=True) if length}
    finally:
        client.close()


def send_run_node(
    settings: Settings, job_id: str, attempt: int, node_rank: int, host: str, request_id: str | None = None
) -> None:
    """Tell ``host`` to run one node of a granted attempt. Send only after the grant committed."""
    get_celery(settings.broker_url).send_task(
        RUN_NODE_TASK, args=[job_id, attempt, node_rank], queue=host_queue(host), headers=_headers(request_id)
    )
