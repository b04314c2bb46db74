"""Partial indexes: the reconciler's reads cost what they look for, and a node's later row versions skip indexes.

- ``ix_job_specs_start_deadline``: the specs that set ``start_deadline_s`` (``core.reconciler._waiting``, every
  pass): the read matched every waiting job's spec text, 118 ms of a 0.3 s reconciler pass at 1,000 hosts and
  10,000 queued jobs (quiet), several times that under load;
- ``ix_jobs_unfilled``: the rows without ``resources`` (``core.scheduler.fill_resources``, every pass: it read every
  waiting row, 49 ms of that pass); empty unless a replica older than 0007 inserts;
- PostgreSQL only: ``ix_job_nodes_state`` over ``assigned`` nodes and ``ix_job_nodes_host_state`` over active ones
  (assigned, launching, running), the only rows their reads ask for. PostgreSQL writes a new version of a row on
  every update, with an entry in each index the version matches: a node's exit (with its release, one update since
  ``worker.node.record_exit``), a loss or a drop added one to both, kept until a vacuum. SQLite updates in place
  and keeps them whole: a partial index serves a query there only where the query names its terms literally.

Revision ID: 0017_partial_indexes
Revises: 0016_hot_updates
Create Date: 2026-12-07 21:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_partial_indexes"
down_revision = "0016_hot_updates"
branch_labels = None
depends_on = None

# as core.models spells them (the reads name the same literal terms)
START_DEADLINE_SPECS = sa.text("""CAST(spec AS TEXT) LIKE '%"start_deadline_s"%'""")
UNFILLED_ROWS = sa.text("resources IS NULL")
ACTIVE_NODES = sa.text("state IN ('assigned', 'launching', 'running')")
ASSIGNED_NODES = sa.text("state = 'assigned'")


def upgrade() -> None:
    op.create_index(
        "ix_job_specs_start_deadline",
        "job_specs",
        ["job_id"],
        postgresql_where=START_DEADLINE_SPECS,
        sqlite_where=START_DEADLINE_SPECS,
    )
    op.create_index("ix_jobs_unfilled", "jobs", ["state"], postgresql_where=UNFILLED_ROWS, sqlite_where=UNFILLED_ROWS)
    if op.get_bind().dialect.name != "postgresql":
        return
    _job_nodes_indexes(active=ACTIVE_NODES, assigned=ASSIGNED_NODES)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _job_nodes_indexes(active=None, assigned=None)
    op.drop_index("ix_jobs_unfilled", table_name="jobs")
    op.drop_index("ix_job_specs_start_deadline", table_name="job_specs")


def _job_nodes_indexes(active: sa.TextClause | None, assigned: sa.TextClause | None) -> None:
    """The two job_nodes indexes by state, over the rows given (None: every row, as 0002 and 0006 made them)."""
    op.drop_index("ix_job_nodes_host_state", table_name="job_nodes")
    op.drop_index("ix_job_nodes_state", table_name="job_nodes")
    op.create_index("ix_job_nodes_host_state", "job_nodes", ["host", "state"], postgresql_where=active)
    op.create_index("ix_job_nodes_state", "job_nodes", ["state"], postgresql_where=assigned)
