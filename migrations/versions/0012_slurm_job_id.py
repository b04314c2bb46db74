"""jobs.slurm_job_id and jobs.slurm_state: a Slurm pool's job (resources.pool) records the id sbatch gave it and the
last Slurm state the agent read (``core.slurm``); the agent tracks the jobs whose Slurm state is not final.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07 07:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("slurm_job_id", sa.String(32), nullable=True))
        batch.add_column(sa.Column("slurm_state", sa.String(32), nullable=True))
    op.create_index(
        "ix_jobs_slurm_live",
        "jobs",
        ["slurm_state"],
        postgresql_where=sa.text("slurm_job_id IS NOT NULL"),
        sqlite_where=sa.text("slurm_job_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_slurm_live", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("slurm_state")
        batch.drop_column("slurm_job_id")
