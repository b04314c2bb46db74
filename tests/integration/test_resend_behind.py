"""The reconciler re-sends a node's message only when it is lost: not while its host's queue still holds messages
(its worker is behind; a copy would only queue behind them). Redis broker, a host of its own (uuid)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from sqlalchemy import select

from core.db import session_scope
from core.messaging import host_queue, send_run_node
from core.models import JobNode, utcnow
from core.recovery import resend_lost_messages
from core_support import isolated_settings, make_job

pytestmark = pytest.mark.redis


def test_a_node_is_resent_only_once_its_hosts_queue_is_empty(tmp_path: Path, redis_url: str) -> None:
    host = f"h-{uuid.uuid4().hex[:10]}"
    settings = isolated_settings(tmp_path, broker_url=redis_url, redispatch_after_s=30)
    job_id = make_job(settings)
    long_ago = utcnow() - timedelta(seconds=120)
    with session_scope(settings.database_url) as session:
        session.add(
            JobNode(
                job_id=job_id, attempt=1, node_rank=0, host=host, devices=[0], master_addr="127.0.0.1",
                master_port=29500, state="assigned", heartbeat_at=long_ago,
            )
        )  # fmt: skip
    queue, client = host_queue(host), redis.Redis.from_url(redis_url)
    try:
        send_run_node(settings, "another-job", 1, 0, host)  # the host's worker has a message it has not taken yet
        assert client.llen(queue) == 1
        assert resend_lost_messages(settings) == 0 and client.llen(queue) == 1
        with session_scope(settings.database_url) as session:
            assert session.scalar(select(JobNode.heartbeat_at)) == long_ago  # not counted as sent
        client.delete(queue)  # the worker took it: a node still assigned now has lost its message
        assert resend_lost_messages(settings) == 1 and client.llen(queue) == 1
        with session_scope(settings.database_url) as session:
            assert session.scalar(select(JobNode.heartbeat_at)) > utcnow() - timedelta(seconds=10)
        assert resend_lost_messages(settings) == 0  # sent just now: left alone
    finally:
        client.delete(queue)
        client.close()
