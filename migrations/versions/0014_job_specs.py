"""job_specs: each job's spec in a table of its own, written once at submission.

A job row is updated several times per job (dispatched, pending reason, starting, running, its end), and PostgreSQL
writes a whole new row version for each update: with the spec inside, the spec (most of the row) was copied every
time, most of the database's growth per finished job. Existing specs move here; the downgrade moves them back.
A replica older than this revision writes ``jobs.spec`` and cannot run beside it.

Revision ID: 0014_job_specs
Revises: 0013
Create Date: 2026-12-07 10:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014_job_specs"
down_revision = "0013"
branch_labels = None
depends_on = None


WAITING_ROWS = sa.text("state IN ('queued', 'retrying') AND kind != 'pipeline'")


def upgrade() -> None:
    # Through a plain table first: on SQLite dropping the column rebuilds ``jobs``, and dropping the old table
    # deletes its rows, which would cascade into a ``job_specs`` made beforehand.
    op.create_table("job_specs_move", sa.Column("job_id", sa.String(36)), sa.Column("spec", sa.JSON()))
    op.execute("INSERT INTO job_specs_move (job_id, spec) SELECT id, spec FROM jobs")
    with op.batch_alter_table("jobs") as batch:  # SQLite rebuilds the table; PostgreSQL drops the column
        batch.drop_column("spec")
    _waiting_turn_index()
    op.create_table(
        "job_specs",
        sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("spec", sa.JSON(), nullable=False),
    )
    op.execute("INSERT INTO job_specs (job_id, spec) SELECT job_id, spec FROM job_specs_move")
    op.drop_table("job_specs_move")


def _waiting_turn_index() -> None:
    """``ix_jobs_waiting_turn`` as 0009 made it: SQLite's table rebuild reflects it without ``priority DESC``."""
    if op.get_bind().dialect.name != "sqlite":
        return
    op.drop_index("ix_jobs_waiting_turn", table_name="jobs")
    op.create_index(
        "ix_jobs_waiting_turn",
        "jobs",
        ["team", "resources", sa.text("priority DESC"), "created_at", "id"],
        sqlite_where=WAITING_ROWS,
    )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("spec", sa.JSON(), nullable=True))
    op.execute("UPDATE jobs SET spec = (SELECT spec FROM job_specs WHERE job_specs.job_id = jobs.id)")
    op.execute("UPDATE jobs SET spec = '{}' WHERE spec IS NULL")
    op.drop_table("job_specs")
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("spec", existing_type=sa.JSON(), nullable=False)
    _waiting_turn_index()
