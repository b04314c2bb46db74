"""Database tables (SQLAlchemy 2 typed ORM). One code path for SQLite and PostgreSQL.

Metrics and logs live here, not on worker disks, so a dead worker host takes nothing with it.
API schemas are separate (``app.schemas``).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    select,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.hybrid import hybrid_property
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeDecorator

from core.states import WAITING

# BIGINT on PostgreSQL, INTEGER on SQLite (the only type SQLite auto-increments).
BigId = BigInteger().with_variant(Integer(), "sqlite")
# The surrogate key of the tables that grow without bound (events, metrics, logs, attempts, ...), spelled once.
BigPk = Annotated[int, mapped_column(BigId, primary_key=True, autoincrement=True)]
# A row that belongs to one job and goes with it when the job is deleted.
JobFk = Annotated[str, mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id() -> str:
    return str(uuid.uuid4())


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on both backends (SQLite would hand back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        aware = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        return aware.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UtcDateTime, dict[str, Any]: JSON}


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("team", "idempotency_key", name="uq_jobs_team_idempotency_key"),
        Index("ix_jobs_team_created", "team", "created_at", "id"),
        Index("ix_jobs_state_updated", "state", "updated_at"),
        Index("ix_jobs_parent", "parent_id"),
        Index("ix_jobs_kind_state", "kind", "state"),  # the reconciler's unfinished pipelines
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    team: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16), default="queued")
    # the spec lives in ``job_specs`` (written once; see ``spec`` below): this row is rewritten on every update
    spec_row: Mapped[JobSpec | None] = relationship(lazy="selectin", cascade="all, delete-orphan", passive_deletes=True)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    body_hash: Mapped[str | None] = mapped_column(String(64))
    queue: Mapped[str] = mapped_column(String(128))
    run_dir: Mapped[str] = mapped_column(Text)
    max_restarts: Mapped[int] = mapped_column(Integer, default=0)
    attempt_count: Mapped[int] = mapped_column(Integer, default=0)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    error_log_tail: Mapped[str | None] = mapped_column(Text)
    pending_reason: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    host: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    dispatched_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    request_id: Mapped[str | None] = mapped_column(String(64))  # the submitting request's (core.structured_logs)
    resources: Mapped[str | None] = mapped_column(Text)  # spec["resources"] as JSON text: what a pass reads
    retry_not_before: Mapped[datetime | None]  # a retrying job waits for this (``core.recovery.retry_backoff``)
    slurm_job_id: Mapped[str | None] = mapped_column(String(32))  # a Slurm pool's job: sbatch's id (core.slurm)
    slurm_state: Mapped[str | None] = mapped_column(String(32))  # the last Slurm state read; tracked until final

    @hybrid_property
    def spec(self) -> dict[str, Any]:
        """The spec as admitted at submission (``job_specs``); in SQL, a correlated read of it."""
        return self.spec_row.spec if self.spec_row is not None else {}

    @spec.inplace.setter
    def _spec_set(self, value: dict[str, Any]) -> None:
        self.spec_row = JobSpec(spec=value)

    @spec.inplace.expression
    @classmethod
    def _spec_sql(cls) -> ColumnElement[Any]:
        return select(JobSpec.spec).where(JobSpec.job_id == cls.id).scalar_subquery()


class JobSpec(Base):
    """A job's spec, written once with the job. A table of its own: the job row is updated several times per job and
    PostgreSQL writes a new version of the whole row on each update (migration 0014)."""

    __tablename__ = "job_specs"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)


# The specs that set a start deadline (``core.reconciler._waiting``, every reconciler pass), as literal SQL that the
# query names too: a stored spec holds only the fields its user set (``spec_to_json``), so a text match finds them.
START_DEADLINE_SPECS = text("""CAST(spec AS TEXT) LIKE '%"start_deadline_s"%'""")
Index(
    "ix_job_specs_start_deadline",
    JobSpec.job_id,
    postgresql_where=START_DEADLINE_SPECS,
    sqlite_where=START_DEADLINE_SPECS,
)

# Waiting rows without ``resources`` (inserted by a replica older than migration 0007): ``core.scheduler.fill_resources``
# on every reconciler pass, which read every waiting job without it. Empty otherwise.
UNFILLED_ROWS = text("resources IS NULL")
Index("ix_jobs_unfilled", Job.state, postgresql_where=UNFILLED_ROWS, sqlite_where=UNFILLED_ROWS)

# The rows a scheduling pass may start, as literal SQL: a query uses the partial index below only where its own
# WHERE names these same terms (SQLite compares them term by term; PostgreSQL proves the implication at planning,
# which a generic plan of bound parameters cannot), so ``core.scheduler`` renders them with these literals too.
WAITING_ROWS = text(
    f"state IN ({', '.join(repr(s.value) for s in sorted(WAITING, key=lambda s: s.value))}) AND kind != 'pipeline'"
)

# A pass reads the first ``schedule_window`` waiting jobs of each team and gang shape (``core.scheduler.waiting_jobs``):
# in this order, per (team, resources), a few index entries each, however long the backlog behind them.
Index(
    "ix_jobs_waiting_turn",
    Job.team,
    Job.resources,
    Job.priority.desc(),
    Job.created_at,
    Job.id,
    postgresql_where=WAITING_ROWS,
    sqlite_where=WAITING_ROWS,
)


# The Slurm agent's live jobs (``core.slurm.tracker``): only Slurm pools' jobs are in it.
Index(
    "ix_jobs_slurm_live",
    Job.slurm_state,
    postgresql_where=text("slurm_job_id IS NOT NULL"),
    sqlite_where=text("slurm_job_id IS NOT NULL"),
)


class ServedName(Base):
    """A model name a live deployment answers to, unique per team: two deployments submitted at once cannot both
    take it (``core.jobs.create_job``). Written with the serve job, deleted when the job ends (``core.jobs.transition``)."""

    __tablename__ = "served_names"
    __table_args__ = (Index("ix_served_names_job", "job_id"),)

    team: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    job_id: Mapped[JobFk]


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),)

    id: Mapped[BigPk]
    job_id: Mapped[JobFk]
    number: Mapped[int] = mapped_column(Integer)
    host: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    argv: Mapped[list[str] | None] = mapped_column(JSON)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    outcome: Mapped[str | None] = mapped_column(String(16))
    error_code: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_job_id", "job_id", "id"),)

    id: Mapped[BigPk]
    job_id: Mapped[JobFk]
    attempt: Mapped[int | None] = mapped_column(Integer)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    type: Mapped[str] = mapped_column(String(32))
    level: Mapped[str] = mapped_column(String(8), default="info")
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class MetricPoint(Base):
    __tablename__ = "metric_points"
    __table_args__ = (
        Index("ix_metric_points_job_step", "job_id", "step", "id"),
        Index("ix_metric_points_job_id", "job_id", "id"),
    )

    id: Mapped[BigPk]
    job_id: Mapped[JobFk]
    step: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(128))
    value: Mapped[float | None] = mapped_column(Float)  # NULL = NaN/Inf (JSON and SQLite have no NaN)
    rank: Mapped[int | None] = mapped_column(Integer)
    time: Mapped[datetime] = mapped_column(default=utcnow)


class LogLine(Base):
    __tablename__ = "log_lines"
    __table_args__ = (
        Index("ix_log_lines_job_stream_seq", "job_id", "stream", "seq"),
        Index("ix_log_lines_job_id", "job_id", "id"),
    )

    id: Mapped[BigPk]
    job_id: Mapped[JobFk]
    stream: Mapped[str] = mapped_column(String(32))  # 'launcher', 'rank0', 'rank1', ...
    seq: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)
    time: Mapped[datetime] = mapped_column(default=utcnow)


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "name", name="uq_artifacts_job_name"),)

    id: Mapped[BigPk]
    job_id: Mapped[JobFk]
    name: Mapped[str] = mapped_column(String(128))
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    files: Mapped[list[str]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[BigPk]
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    team: Mapped[str] = mapped_column(String(64))
    name: Mapped[str | None] = mapped_column(String(200))
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class Host(Base):
    __tablename__ = "hosts"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    device_type: Mapped[str] = mapped_column(String(16))
    devices: Mapped[int] = mapped_column(Integer, default=0)
    queue: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="up")  # up | down
    info: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    address: Mapped[str | None] = mapped_column(String(255))  # where other nodes reach this host (rendezvous)
    device_ids: Mapped[list[int] | None] = mapped_column(JSON)  # physical ids; None = range(devices)


class Lease(Base):
    """One device of one host held by one node of one job attempt. Rows exist only while held."""

    __tablename__ = "leases"
    __table_args__ = (
        UniqueConstraint("host", "device", name="uq_leases_host_device"),
        Index("ix_leases_job", "job_id"),
    )

    id: Mapped[BigPk]
    host: Mapped[str] = mapped_column(String(255))
    device: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[JobFk]
    team: Mapped[str] = mapped_column(String(64))
    attempt: Mapped[int] = mapped_column(Integer)
    node_rank: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


# What the job_nodes indexes by state hold on PostgreSQL, where every update writes a new version of the row with an
# entry in each index it matches (migration 0017): every read of them by host and state asks for active nodes, the
# one by state alone for assigned ones. SQLite updates in place and keeps them whole (a partial index serves a query
# there only where the query names the same literal terms).
ACTIVE_NODES = text("state IN ('assigned', 'launching', 'running')")
ASSIGNED_NODES = text("state = 'assigned'")


class JobNode(Base):
    """One node of one attempt of a (possibly multi-node) job: where it runs, its devices, its rendezvous, its state.

    state: assigned (message sent) -> launching -> running -> exited; or lost (host died / worker restarted) or
    dropped (never launched: cancelled or superseded). ``released_at`` is set once its leases are given back.
    """

    __tablename__ = "job_nodes"
    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "node_rank", name="uq_job_nodes_attempt_rank"),
        # partial on PostgreSQL (migration 0017): a node's later versions (exited, lost, dropped) add no entry
        Index("ix_job_nodes_host_state", "host", "state", postgresql_where=ACTIVE_NODES),  # read for active ones
        Index("ix_job_nodes_state", "state", postgresql_where=ASSIGNED_NODES),  # nodes still assigned (lost messages)
        Index(  # a host's nodes holding devices, read on every heartbeat of every host
            "ix_job_nodes_unreleased",
            "host",
            postgresql_where=text("released_at IS NULL"),
            sqlite_where=text("released_at IS NULL"),
        ),
    )

    id: Mapped[BigPk]
    job_id: Mapped[JobFk]
    attempt: Mapped[int] = mapped_column(Integer)
    node_rank: Mapped[int] = mapped_column(Integer)
    host: Mapped[str] = mapped_column(String(255))
    devices: Mapped[list[int]] = mapped_column(JSON)
    master_addr: Mapped[str] = mapped_column(String(255))
    master_port: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="assigned")
    worker_pid: Mapped[int | None] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    released_at: Mapped[datetime | None]


class SchedulerLock(Base):
    """Row 1: every scheduling transaction updates it first, which serialises schedulers on both backends (a row
    lock on PostgreSQL, the database write lock on SQLite). Row 2: its ``generation`` counts the passes asked for
    while one ran (``core.scheduler.schedule``)."""

    __tablename__ = "scheduler_lock"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    generation: Mapped[int] = mapped_column(BigInteger, default=0)
    passed_at: Mapped[datetime | None]  # the last pass's start, anywhere: heartbeats' backstop passes wait on it


class Webhook(Base):
    """A team's webhook endpoint (``core.webhooks``); ``cursor`` is the last ``events.id`` fanned out to it."""

    __tablename__ = "webhooks"
    __table_args__ = (Index("ix_webhooks_team", "team"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    team: Mapped[str] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(Text)
    secret: Mapped[str] = mapped_column(
        String(512)
    )  # whsec_<base64> sealed by app.secrets_box (the sender signs with it)
    events: Mapped[list[str]] = mapped_column(JSON)
    description: Mapped[str | None] = mapped_column(String(200))
    cursor: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    disabled_at: Mapped[datetime | None]


class WebhookDelivery(Base):
    """One message (one event for one webhook); its id is the ``webhook-id`` header, the same on every retry."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("webhook_id", "event_id", name="uq_webhook_deliveries_event"),
        Index("ix_webhook_deliveries_due", "state", "next_attempt_at"),
        Index("ix_webhook_deliveries_webhook", "webhook_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    webhook_id: Mapped[str] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    event_id: Mapped[int] = mapped_column(BigInteger)
    job_id: Mapped[str] = mapped_column(String(36))
    type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), default="pending")  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None]
    last_status: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None]


class WebhookAttempt(Base):
    """Every POST of a delivery: when, the HTTP status or the connection error, how long it took."""

    __tablename__ = "webhook_attempts"
    __table_args__ = (Index("ix_webhook_attempts_delivery", "delivery_id", "number"),)

    id: Mapped[BigPk]
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    time: Mapped[datetime] = mapped_column(default=utcnow)
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    response_body: Mapped[str | None] = mapped_column(Text)
    duration_ms: Mapped[float] = mapped_column(Float)


class MlflowExperiment(Base):
    """An MLflow experiment of a team (``core.mlflow_store``): one a notebook created, or the grouping of the team's
    jobs (a job's ``metadata.experiment``, else the team's name), made a row the first time the API reads it."""

    __tablename__ = "mlflow_experiments"
    __table_args__ = (UniqueConstraint("team", "name", name="uq_mlflow_experiments_team_name"),)

    id: Mapped[BigPk]
    team: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(500))
    artifact_location: Mapped[str] = mapped_column(Text, default="")
    lifecycle_stage: Mapped[str] = mapped_column(String(16), default="active")
    tags: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class MlflowRun(Base):
    """A run logged through the MLflow API (a notebook's); a job is a run too, read from its own rows."""

    __tablename__ = "mlflow_runs"
    __table_args__ = (Index("ix_mlflow_runs_team_experiment", "team", "experiment_id"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    team: Mapped[str] = mapped_column(String(64))
    experiment_id: Mapped[int] = mapped_column(ForeignKey("mlflow_experiments.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(250), default="")
    user_id: Mapped[str] = mapped_column(String(250), default="")
    status: Mapped[str] = mapped_column(String(16), default="RUNNING")
    lifecycle_stage: Mapped[str] = mapped_column(String(16), default="active")
    start_time: Mapped[int] = mapped_column(BigInteger)  # epoch milliseconds, as MLflow sends them
    end_time: Mapped[int | None] = mapped_column(BigInteger)


class MlflowParam(Base):
    __tablename__ = "mlflow_params"

    run_id: Mapped[str] = mapped_column(ForeignKey("mlflow_runs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(250), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class MlflowTag(Base):
    __tablename__ = "mlflow_tags"

    run_id: Mapped[str] = mapped_column(ForeignKey("mlflow_runs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(250), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class MlflowMetric(Base):
    """One logged point. ``value`` is NULL for a non-finite one, which ``special`` names (NaN, Infinity, -Infinity):
    SQLite keeps no NaN."""

    __tablename__ = "mlflow_metrics"
    __table_args__ = (Index("ix_mlflow_metrics_run_key", "run_id", "key", "id"),)

    id: Mapped[BigPk]
    run_id: Mapped[str] = mapped_column(ForeignKey("mlflow_runs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(250))
    value: Mapped[float | None] = mapped_column(Float)
    special: Mapped[str | None] = mapped_column(String(16))
    timestamp: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(BigInteger, default=0)


class MlflowReport(Base):
    """Where a ``report_to: ["mlflow"]`` job's mirror stands (``core.mlflow_report``): its run on the remote server,
    the last metric point sent, and the backoff after a failed send."""

    __tablename__ = "mlflow_reports"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    remote_run_id: Mapped[str | None] = mapped_column(String(64))
    params_sent: Mapped[bool] = mapped_column(Boolean, default=False)
    cursor: Mapped[int] = mapped_column(BigInteger, default=0)  # metric_points.id of the last point sent
    finished: Mapped[bool] = mapped_column(Boolean, default=False)
    failures: Mapped[int] = mapped_column(Integer, default=0)  # in a row; 0 after a send that worked
    next_try_at: Mapped[datetime | None]
    last_error: Mapped[str | None] = mapped_column(Text)


class Sweep(Base):
    """A hyperparameter search (``core.sweeps``): its trials are ordinary train jobs labelled ``sweep`` = this id; the
    Optuna study is rebuilt from them each pass, with what samplers and pruners remember kept in ``trial_attrs``."""

    __tablename__ = "sweeps"
    __table_args__ = (Index("ix_sweeps_team_created", "team", "created_at"), Index("ix_sweeps_state", "state"))

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    team: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), default="running")  # running | succeeded | failed | cancelled
    trial_attrs: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # job id -> Optuna system attrs
    pruned: Mapped[list[str]] = mapped_column(JSON, default=list)  # job ids stopped by the pruner
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class TeamSecret(Base):
    """A value a team stores for the service to use on its behalf (the token ``report_to`` sends to a tracking
    server), sealed at rest by ``core.secrets_box``; the API never answers it back (``core.team_secrets``)."""

    __tablename__ = "team_secrets"

    team: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[str] = mapped_column(Text)  # fernet:<token>
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class TeamTracking(Base):
    """A team's default ``report_to`` (set by an admin): filled into a train spec field by field where the spec sets
    none (``core.tracking``)."""

    __tablename__ = "team_tracking"

    team: Mapped[str] = mapped_column(String(64), primary_key=True)
    report_to: Mapped[list[str]] = mapped_column(JSON, default=list)
    mlflow_tracking_uri: Mapped[str | None] = mapped_column(String(2000))
    mlflow_experiment: Mapped[str | None] = mapped_column(String(500))
    mlflow_token_secret: Mapped[str | None] = mapped_column(String(100))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
