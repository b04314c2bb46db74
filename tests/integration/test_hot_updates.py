"""Migration 0016 on PostgreSQL: the control plane's most updated tables keep room on each page, so a heartbeat's
update stays on its row's page (HOT: no index entry, pruned in place) instead of growing the table and its indexes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from core.db import alembic_config, get_engine, upgrade_head
from core_support import fresh_postgres_database

pytestmark = pytest.mark.postgres

HOSTS = 200
INFO = (
    '{"platform": "Linux-6.1.0-x86_64-with-glibc2.36", "python": "3.11.7", "node": "n", "device_memory": 85899345920}'
)


@pytest.fixture
def pg_database(postgres_url: str) -> Iterator[str]:
    with fresh_postgres_database(postgres_url) as url:
        yield url


def _fillfactors(engine: sa.Engine) -> dict[str, list[str] | None]:
    query = "SELECT relname, reloptions FROM pg_class WHERE relname IN ('hosts', 'jobs', 'job_nodes', 'scheduler_lock')"
    with engine.connect() as connection:
        return {name: options for name, options in connection.execute(sa.text(query))}


def _hot_share(engine: sa.Engine) -> tuple[float, int]:
    """Beats of ``HOSTS`` hosts, 5 rounds of 20 hosts to a statement (as ``worker.hosts.beat_many`` stamps them):
    the share of those updates that were HOT, and how many bytes the table grew by (its indexes included)."""
    with engine.begin() as connection:
        connection.execute(sa.text("TRUNCATE hosts"))
        connection.execute(
            sa.text(
                "INSERT INTO hosts (name, device_type, devices, queue, state, info, started_at, heartbeat_at) "
                "SELECT 'sim-' || g, 'cuda', 8, 'cuda,host.sim-' || g, 'up', CAST(:info AS json), now(), now() "
                "FROM generate_series(1, :n) g"
            ),
            {"info": INFO, "n": HOSTS},
        )
    before, size = _counts(engine), _size(engine)
    for _ in range(5):
        for first in range(1, HOSTS + 1, 20):
            with engine.begin() as connection:
                names = [f"sim-{i}" for i in range(first, first + 20)]
                connection.execute(sa.text("UPDATE hosts SET heartbeat_at = now() WHERE name = ANY(:n)"), {"n": names})
    deadline = time.monotonic() + 30
    while (after := _counts(engine))[0] - before[0] < 5 * HOSTS and time.monotonic() < deadline:
        time.sleep(0.2)  # a backend's table statistics reach pg_stat_user_tables within a second or so
    updated, hot = after[0] - before[0], after[1] - before[1]
    assert updated == 5 * HOSTS, f"statistics never showed the {5 * HOSTS} updates ({updated})"
    return hot / updated, _size(engine) - size


def _size(engine: sa.Engine) -> int:
    with engine.connect() as connection:
        return int(connection.scalar(sa.text("SELECT pg_total_relation_size('hosts')")) or 0)


def _counts(engine: sa.Engine) -> tuple[int, int]:
    with engine.connect() as connection:
        connection.execute(sa.text("SELECT pg_stat_force_next_flush()"))
        updated, hot = connection.execute(
            sa.text("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'hosts'")
        ).one()
        return int(updated), int(hot)


def test_heartbeats_stay_on_their_page_after_0016_and_not_before(pg_database: str, tmp_path: Path) -> None:
    engine = get_engine(pg_database)
    upgrade_head(pg_database)
    options = _fillfactors(engine)
    assert options["hosts"] == ["fillfactor=70"] and options["jobs"] == ["fillfactor=70"]
    assert options["job_nodes"] == ["fillfactor=80"] and options["scheduler_lock"] == ["fillfactor=50"]
    with_room = _hot_share(engine)
    command.downgrade(alembic_config(pg_database), "0015_team_tracking")
    assert all(o is None for o in _fillfactors(engine).values())
    packed = _hot_share(engine)
    # measured: 93 % HOT, 24 KiB grown with room; 76 %, 48 KiB packed (the first round moves every row of a full page)
    assert with_room[0] >= 0.85 and packed[0] <= with_room[0] - 0.1, (with_room, packed)
    assert with_room[1] < packed[1], (with_room, packed)
