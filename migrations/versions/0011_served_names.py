"""served_names: the model names live deployments answer to, unique per team (two deployments submitted at once
could both pass a check read in Python); jobs.retry_not_before: a retrying job waits for it (backoff per attempt).

Backfills the names of the deployments live now; where two already share a name (possible before this), the newer
one keeps it, as requests went to the newer one.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 06:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

TERMINAL = ("succeeded", "failed", "cancelled")


def upgrade() -> None:
    op.create_table(
        "served_names",
        sa.Column("team", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("team", "name"),
    )
    op.create_index("ix_served_names_job", "served_names", ["job_id"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("retry_not_before", sa.DateTime(timezone=True), nullable=True))
    _backfill()


def _backfill() -> None:
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.String()),
        sa.column("team", sa.String()),
        sa.column("kind", sa.String()),
        sa.column("name", sa.String()),
        sa.column("state", sa.String()),
        sa.column("spec", sa.JSON()),
        sa.column("created_at", sa.DateTime(timezone=True)),
    )
    names = sa.table("served_names", sa.column("team"), sa.column("name"), sa.column("job_id"))
    live = (
        sa.select(jobs.c.id, jobs.c.team, jobs.c.name, jobs.c.spec)
        .where(jobs.c.kind == "serve", jobs.c.state.not_in(TERMINAL))
        .order_by(jobs.c.created_at.desc(), jobs.c.id.desc())  # the newest first: it keeps a shared name
    )
    rows: dict[tuple[str, str], str] = {}
    for job_id, team, name, spec in op.get_bind().execute(live):
        spec = spec if isinstance(spec, dict) else {}
        served = spec.get("served_model_name")
        adapters = spec.get("lora_adapters") if isinstance(spec.get("lora_adapters"), dict) else {}
        for served_name in [served or name or job_id, *adapters]:
            rows.setdefault((team, str(served_name)), job_id)
    if rows:
        op.bulk_insert(names, [{"team": t, "name": n, "job_id": j} for (t, n), j in rows.items()])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("retry_not_before")
    op.drop_index("ix_served_names_job", table_name="served_names")
    op.drop_table("served_names")
