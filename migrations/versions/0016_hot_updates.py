"""Room on each page of the control plane's most updated tables, so their updates stay HOT.

PostgreSQL writes a new version of a row on every UPDATE. When the new version fits on the row's own page and no
indexed column changed, it is a heap-only tuple (HOT): no index entry is added and the old version is pruned on the
page's next read, so the table does not grow. On a page packed full (the default fillfactor, 100) the new version
goes to another page with an entry in every index of the table: a heartbeat (``hosts.heartbeat_at``), a pending
reason (``jobs.pending_reason``), a node's heartbeat (``job_nodes.heartbeat_at``) each grew the table and all its
indexes until a vacuum. A lower fillfactor leaves that room on every page written from now on (existing pages are
left as they are until rewritten). SQLite updates rows in place: nothing to do there.

Revision ID: 0016_hot_updates
Revises: 0015_team_tracking
Create Date: 2026-12-07 13:30:00
"""

from __future__ import annotations

from alembic import op

revision = "0016_hot_updates"
down_revision = "0015_team_tracking"
branch_labels = None
depends_on = None

# table -> fillfactor (percent of each page filled by inserts). hosts: one row per host rewritten on every heartbeat;
# jobs: pending reasons, dispatch stamps and job heartbeats between state changes; job_nodes: node heartbeats.
FILLFACTORS = {"hosts": 70, "jobs": 70, "job_nodes": 80, "scheduler_lock": 50}


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, percent in FILLFACTORS.items():
        op.execute(f"ALTER TABLE {table} SET (fillfactor = {percent})")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in FILLFACTORS:
        op.execute(f"ALTER TABLE {table} RESET (fillfactor)")
