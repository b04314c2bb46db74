"""A gang is all or nothing at run time too: when one node of a 2-node job cannot launch, the attempt fails and the
node that did start is stopped (its process killed, its devices given back)."""

from __future__ import annotations

import sys
from pathlib import Path

from sqlalchemy import select

from core.db import session_scope
from core.models import Host, Job, Lease
from core.scheduler import schedule
from core_support import isolated_settings, make_job
from worker.launcher import LaunchPlan
from worker.leases import NODE_ENV, node_processes, node_token, release_node
from worker.node import claim_node, launch_failed, mark_running, watch_node
from worker.supervisor import Supervised


def test_one_node_failing_to_launch_stops_the_other(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, heartbeat_interval_s=0.2, ingest_interval_s=0.1, cancel_grace_s=2)
    with session_scope(settings.database_url) as session:
        for name in ("h1", "h2"):
            session.add(
                Host(name=name, device_type="cpu", devices=1, queue=f"host.{name}", address="127.0.0.1", info={})
            )
    job_id = make_job(settings, resources={"nnodes": 2}, max_restarts=0)
    assert [g.hosts for g in schedule(settings)] == [["h1", "h2"]]
    node0 = claim_node(settings, job_id, 1, 0, "h1")
    node1 = claim_node(settings, job_id, 1, 1, "h2")
    assert node0 is not None and node1 is not None
    token = node_token(job_id, 1, 0)
    plan = LaunchPlan(argv=[sys.executable, "-c", "import time; time.sleep(120)"], env={NODE_ENV: token}, cwd=tmp_path)
    proc = Supervised(plan, tmp_path / "node0.log")
    mark_running(settings, node0, proc.pid, plan.argv, "h1")
    with session_scope(settings.database_url) as session:
        assert session.get(Job, job_id).state == "starting"  # type: ignore[union-attr]  # node 1 is not running yet

    assert launch_failed(settings, node1, RuntimeError("no such interpreter")) == "failed"
    code, stop = watch_node(settings, node0, proc, None)  # node 0 notices and stops
    assert stop == "superseded" and code != 0
    assert release_node(settings, node0.node_id)
    assert node_processes(token) == []
    with session_scope(settings.database_url) as session:
        job = session.get(Job, job_id)
        assert job is not None and (job.state, job.error_code) == ("failed", "retries_exhausted")
        assert "node 1 could not launch: no such interpreter" in (job.error_message or "")
        assert session.scalars(select(Lease)).all() == []
