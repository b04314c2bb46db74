"""MLflow tracking tables: a team's experiments and the runs a notebook logs through /api/2.0/mlflow/ (their params,
tags and metric points); jobs are runs too, read from their own rows (``core.mlflow_store``); and where each
``report_to: ["mlflow"]`` job's mirror to a remote MLflow server stands (``core.mlflow_report``); and sweeps (``core.sweeps``), whose trials are train jobs.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
WHEN = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "mlflow_experiments",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("team", sa.String(64), nullable=False),
        sa.Column("name", sa.String(500), nullable=False),
        sa.Column("artifact_location", sa.Text(), nullable=False),
        sa.Column("lifecycle_stage", sa.String(16), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("created_at", WHEN, nullable=False),
        sa.Column("updated_at", WHEN, nullable=False),
        sa.UniqueConstraint("team", "name", name="uq_mlflow_experiments_team_name"),
    )
    op.create_table(
        "mlflow_runs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("team", sa.String(64), nullable=False),
        sa.Column("experiment_id", BIG_ID, sa.ForeignKey("mlflow_experiments.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(250), nullable=False),
        sa.Column("user_id", sa.String(250), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("lifecycle_stage", sa.String(16), nullable=False),
        sa.Column("start_time", sa.BigInteger(), nullable=False),
        sa.Column("end_time", sa.BigInteger(), nullable=True),
    )
    op.create_index("ix_mlflow_runs_team_experiment", "mlflow_runs", ["team", "experiment_id"])
    for table in ("mlflow_params", "mlflow_tags"):
        op.create_table(
            table,
            sa.Column("run_id", sa.String(32), sa.ForeignKey("mlflow_runs.id", ondelete="CASCADE"), primary_key=True),
            sa.Column("key", sa.String(250), primary_key=True),
            sa.Column("value", sa.Text(), nullable=False),
        )
    op.create_table(
        "mlflow_metrics",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(32), sa.ForeignKey("mlflow_runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("key", sa.String(250), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("special", sa.String(16), nullable=True),
        sa.Column("timestamp", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_mlflow_metrics_run_key", "mlflow_metrics", ["run_id", "key", "id"])
    op.create_table(
        "mlflow_reports",
        sa.Column("job_id", sa.String(36), sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("remote_run_id", sa.String(64), nullable=True),
        sa.Column("params_sent", sa.Boolean(), nullable=False),
        sa.Column("cursor", sa.BigInteger(), nullable=False),
        sa.Column("finished", sa.Boolean(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("next_try_at", WHEN, nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
    )
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("team", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("trial_attrs", sa.JSON(), nullable=False),
        sa.Column("pruned", sa.JSON(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("created_at", WHEN, nullable=False),
        sa.Column("finished_at", WHEN, nullable=True),
    )
    op.create_index("ix_sweeps_team_created", "sweeps", ["team", "created_at"])
    op.create_index("ix_sweeps_state", "sweeps", ["state"])


def downgrade() -> None:
    op.drop_index("ix_sweeps_state", table_name="sweeps")
    op.drop_index("ix_sweeps_team_created", table_name="sweeps")
    op.drop_table("sweeps")
    op.drop_table("mlflow_reports")
    op.drop_index("ix_mlflow_metrics_run_key", table_name="mlflow_metrics")
    op.drop_table("mlflow_metrics")
    op.drop_table("mlflow_tags")
    op.drop_table("mlflow_params")
    op.drop_index("ix_mlflow_runs_team_experiment", table_name="mlflow_runs")
    op.drop_table("mlflow_runs")
    op.drop_table("mlflow_experiments")
