"""Multi-node on one machine: two `llmjobs worker` processes act as two hosts (loopback rendezvous). A 2-node ×
1-process training job is gang-allocated across them, runs only when both nodes run, and ends with the same losses
as the 1-node × 2-process run of the same global configuration."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from core.db import session_scope
from core.models import Event, JobNode, Lease, MetricPoint
from core.settings import Settings
from core_support import isolated_settings
from sched_support import (
    job_processes,
    job_row,
    log_text,
    reconciler,
    start_worker,
    stop_worker,
    submit,
    tiny_data,
    train_spec,
    wait_terminal,
)

pytestmark = pytest.mark.slow


def losses(settings: Settings, job_id: str) -> list[float]:
    with session_scope(settings.database_url) as session:
        return list(
            session.scalars(
                select(MetricPoint.value)
                .where(MetricPoint.job_id == job_id, MetricPoint.name == "lm_loss", MetricPoint.rank.is_(None))
                .order_by(MetricPoint.step)
            )
        )  # type: ignore[arg-type]


def test_two_node_job_matches_one_node_run(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, heartbeat_interval_s=1, host_stale_after_s=20, ingest_interval_s=0.3)
    data = tiny_data(settings)
    workers = [start_worker(settings, h, 2, tmp_path / f"{h}.log") for h in ("h1", "h2")]
    try:
        with reconciler(settings):
            one = submit(settings, train_spec(data, resources={"nproc_per_node": 2}))
            two = submit(settings, train_spec(data, resources={"nnodes": 2, "nproc_per_node": 1}))
            assert wait_terminal(settings, one, 180).state == "succeeded", log_text(settings, one)
            row = wait_terminal(settings, two, 180)
            assert row.state == "succeeded", log_text(settings, two)
    finally:
        for w in workers:
            stop_worker(w)
    with session_scope(settings.database_url) as session:
        nodes = list(session.scalars(select(JobNode).where(JobNode.job_id == two).order_by(JobNode.node_rank)))
        states = [
            e.data.get("state")
            for e in session.scalars(select(Event).where(Event.job_id == two, Event.type == "state").order_by(Event.id))
        ]
        assert session.scalars(select(Lease)).all() == []  # every device given back
    assert sorted(n.host for n in nodes) == ["h1", "h2"] and [n.exit_code for n in nodes] == [0, 0]
    assert nodes[0].master_addr == nodes[1].master_addr == "127.0.0.1" and nodes[0].master_port == nodes[1].master_port
    assert states == ["queued", "starting", "running", "succeeded"]
    launcher1 = Path(job_row(settings, two).run_dir) / "logs" / "launcher-node1.log"
    assert launcher1.exists()
    ref, multi = losses(settings, one), losses(settings, two)
    assert len(ref) == len(multi) == 4
    assert multi == pytest.approx(ref, rel=1e-5, abs=1e-6), (ref, multi)
    assert job_processes(one) == job_processes(two) == []
