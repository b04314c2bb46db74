"""Indexes for the control plane's periodic queries, so they cost what is active, not the whole history

- ``ix_jobs_kind_state``: the reconciler's unfinished pipelines (``core.pipelines.advance_all``);
- ``ix_job_nodes_state``: nodes still ``assigned`` (``core.recovery.resend_lost_messages``);
- ``ix_job_nodes_unreleased``: a host's nodes whose devices are not given back yet (``worker.leases.sweep_host`` and
  ``worker.node.finish_parked``, on every heartbeat of every host), partial: only rows with ``released_at`` NULL.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

UNRELEASED = sa.text("released_at IS NULL")


def upgrade() -> None:
    op.create_index("ix_jobs_kind_state", "jobs", ["kind", "state"])
    op.create_index("ix_job_nodes_state", "job_nodes", ["state"])
    op.create_index(
        "ix_job_nodes_unreleased", "job_nodes", ["host"], postgresql_where=UNRELEASED, sqlite_where=UNRELEASED
    )


def downgrade() -> None:
    op.drop_index("ix_job_nodes_unreleased", table_name="job_nodes")
    op.drop_index("ix_job_nodes_state", table_name="job_nodes")
    op.drop_index("ix_jobs_kind_state", table_name="jobs")
