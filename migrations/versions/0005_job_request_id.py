"""jobs.request_id: the id of the API request that submitted a job, carried into its broker messages and worker logs

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 16:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("request_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("request_id")
