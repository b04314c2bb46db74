"""A team's sealed secrets (the token ``report_to`` sends to a tracking server, ``core.team_secrets``) and its default
``report_to`` setting (``core.tracking``).

Revision ID: 0015_team_tracking
Revises: 0014_job_specs
Create Date: 2026-12-07 10:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_team_tracking"
down_revision = "0014_job_specs"
branch_labels = None
depends_on = None

WHEN = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "team_secrets",
        sa.Column("team", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("created_at", WHEN, nullable=False),
        sa.Column("updated_at", WHEN, nullable=False),
    )
    op.create_table(
        "team_tracking",
        sa.Column("team", sa.String(64), primary_key=True),
        sa.Column("report_to", sa.JSON(), nullable=False),
        sa.Column("mlflow_tracking_uri", sa.String(2000), nullable=True),
        sa.Column("mlflow_experiment", sa.String(500), nullable=True),
        sa.Column("mlflow_token_secret", sa.String(100), nullable=True),
        sa.Column("updated_at", WHEN, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("team_tracking")
    op.drop_table("team_secrets")
