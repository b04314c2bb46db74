"""The worker's sweep: a node no task of this worker runs (its previous worker died, or its task died) is marked
lost, its processes are killed, its devices are freed and its job re-queued; a node a task runs is left alone."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sqlalchemy import select

from core.db import session_scope
from core.models import Host, Job, JobNode, Lease
from core.scheduler import schedule
from core_support import isolated_settings, make_job
from worker.launcher import LaunchPlan
from worker.leases import NODE_ENV, node_processes, node_token, running_here, sweep_host
from worker.node import claim_node, mark_running
from worker.supervisor import Supervised


def test_sweep_frees_orphans_and_spares_running_nodes(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path)
    with session_scope(settings.database_url) as session:
        session.add(Host(name="h1", device_type="cpu", devices=2, queue="host.h1", address="127.0.0.1", info={}))
    orphan_job, kept_job = make_job(settings, max_restarts=1), make_job(settings)
    schedule(settings)
    procs = {}
    for job_id in (orphan_job, kept_job):
        work = claim_node(settings, job_id, 1, 0, "h1")
        assert work is not None
        plan = LaunchPlan(
            argv=[sys.executable, "-c", "import time; time.sleep(120)"],
            env={NODE_ENV: node_token(job_id, 1, 0)},
            cwd=tmp_path,
        )
        procs[job_id] = Supervised(plan, tmp_path / f"{job_id}.log")
        mark_running(settings, work, procs[job_id].pid, plan.argv, "h1")

    with running_here(node_token(kept_job, 1, 0)):
        assert sweep_host(settings, "h1", os.getpid()) == 1
    procs[orphan_job].wait(10)
    assert node_processes(node_token(orphan_job, 1, 0)) == []
    assert procs[kept_job].poll() is None and node_processes(node_token(kept_job, 1, 0))
    with session_scope(settings.database_url) as session:
        assert session.get(Job, orphan_job).state == "retrying"  # type: ignore[union-attr]
        assert session.get(Job, kept_job).state == "running"  # type: ignore[union-attr]
        assert list(session.scalars(select(Lease.job_id))) == [kept_job]
        lost = session.scalars(select(JobNode).where(JobNode.job_id == orphan_job)).one()
        assert lost.state == "lost" and "died while running it" in (lost.reason or "")
    procs[kept_job].terminate(1)
