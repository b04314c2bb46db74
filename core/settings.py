"""Service configuration: one pydantic-settings class read from ``LLMJOBS_*`` environment variables.

Defaults give the embedded setup that ``make run`` starts: a SQLite database file, Celery's SQLAlchemy transport on its
own SQLite file, data and run directories under ``<repo>/var``. Production points the URLs at PostgreSQL and Redis.
"""

from __future__ import annotations

import socket
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parents[1]


class SlurmPool(BaseModel):
    """One Slurm partition jobs may name with ``resources.pool`` (``LLMJOBS_SLURM_POOLS``, JSON: name -> pool).
    The service's runs_dir and the engine's Python must be on a filesystem the pool's nodes share."""

    model_config = ConfigDict(extra="forbid")

    partition: str = Field(min_length=1, description="sbatch --partition.")
    gres_per_node: str | None = Field(None, description="sbatch --gres, site-specific (e.g. 'npu:8', 'gpu:a100:8').")
    devices_per_node: int = Field(ge=1, le=64, description="Devices one node of the pool has.")
    device_type: Literal["cpu", "cuda", "npu"] = Field("cpu", description="The pool's accelerator type.")
    device_memory_gib: float | None = Field(None, gt=0, description="Memory of one device; the planner checks it.")
    host_memory_gib: float | None = Field(None, gt=0, description="Memory of one node (sbatch --mem).")
    account: str | None = Field(None, description="sbatch --account.")
    qos: str | None = Field(None, description="sbatch --qos.")
    time_limit: str | None = Field(None, description="sbatch --time (Slurm's syntax, e.g. '2-00:00:00').")
    max_nodes: int = Field(1024, ge=1, description="Nodes one job of this pool may span.")
    extra_sbatch: list[str] = Field(default_factory=list, description="More '--flag=value' lines for #SBATCH.")
    constraint: str | None = Field(None, description="sbatch --constraint.")
    requeue: bool = Field(True, description="sbatch --requeue: Slurm may requeue the job (preemption, node failure).")
    python: str | None = Field(None, description="The engine's Python on the nodes; default the service's own.")
    rdzv_port: int = Field(29500, ge=1024, le=65535, description="torchrun's c10d rendezvous port on the head node.")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLMJOBS_", extra="ignore")

    var_dir: Path = Field(REPO_ROOT / "var", description="Where the embedded defaults keep their files.")
    database_url: str = Field("", description="SQLAlchemy URL; default sqlite:///<var_dir>/llmjobs.db.")
    broker_url: str = Field("", description="Celery broker; default sqla+sqlite:///<var_dir>/broker.db.")
    redis_url: str | None = Field(None, description="Optional Redis for pub/sub, so SSE streams are pushed.")
    data_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated directories every job path must stay inside; default <var_dir>/data.",
    )
    shared_data_areas: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated directories every team may read but not write (inputs "
        "only); a relative one names that directory in each data root (e.g. "
        "'shared'). Each team otherwise reads and writes only <root>/teams/<team>/.",
    )
    runs_dir: Path | None = Field(None, description="Run directories (<runs_dir>/<job_id>); default <var_dir>/runs.")
    host: str = Field("127.0.0.1", description="Where the API listens (`make run` and `llmjobs serve` honour it).")
    port: int = Field(8000, ge=0, le=65535, description="The API's port.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Larger request bodies are refused with 413.")
    upload_max_bytes: int = Field(
        10 * 2**30, ge=1, description="Larger file uploads (PUT /v1/files/{path}) are refused with 413."
    )
    team_storage_quota_bytes: int = Field(
        0,
        ge=0,
        description="What one team may store in its data areas (uploads and job outputs, every data root); an "
        "upload that would pass it is refused with 413 storage_quota_exceeded. 0: no quota.",
    )
    default_max_restarts: int = Field(2, ge=0, description="Retries after a retryable failure when a spec sets none.")
    retry_backoff_s: float = Field(
        10.0,
        ge=0,
        description="A retried job waits this long before its second attempt, twice as long before each next one "
        "(up to retry_backoff_max_s); an attempt that started no process, or that a worker shutdown stopped, is "
        "retried at once. 0: no wait.",
    )
    retry_backoff_max_s: float = Field(300.0, ge=0, description="The longest wait between two attempts of a job.")
    admission_trace_s: float = Field(
        0.0,
        ge=0,
        description="Admission traces a job's step on fake device tensors (python -m engine trace, a child process) "
        "instead of planning it, for features the planner has no model of (engine.contract.trace_admission: MoE on npu), "
        "within this many seconds; over it, or when the trace fails, the planner decides. 0: the planner alone.",
    )
    cancel_grace_s: float = Field(10.0, ge=0, description="SIGTERM -> SIGKILL grace period on cancel.")
    redispatch_after_s: float = Field(
        30.0, gt=0, description="The reconciler re-sends a queued job's message after this."
    )
    reconcile_interval_s: float = Field(
        5.0,
        gt=0,
        description="How often the leading API replica reconciles (recovery, pipelines, scheduling, deadlines, lost messages).",
    )
    dispatch_min_interval_s: float = Field(
        0.2,
        ge=0,
        description="The API's scheduling pass for new submissions runs at most this often (submissions coalesce).",
    )
    heartbeat_interval_s: float = Field(5.0, gt=0, description="How often a worker heart-beats its host.")
    host_stale_after_s: float = Field(
        30.0, gt=0, description="A host without a heartbeat for this long counts as down."
    )
    host_absent_after_s: float = Field(
        6.0,
        gt=0,
        description="A host whose worker's presence is gone (its database session ended: SIGKILL, the host vanished; "
        "or, on one machine, its pid) and whose heartbeat is this old goes down at once, without waiting for "
        "host_stale_after_s. Never less than heartbeat_interval_s + 1.",
    )
    presence_interval_s: float = Field(
        1.0, gt=0, description="How often the leading API replica checks silent hosts' presence (host_absent_after_s)."
    )
    worker_presence_lock: bool = Field(
        True,
        description="PostgreSQL: each worker holds a session advisory lock on a connection of its own while it runs "
        "(one more connection per host), so its death is seen in seconds (host_absent_after_s).",
    )
    disk_wait_below_bytes: int = Field(
        2 * 2**30,
        ge=0,
        description="High watermark: while a data root has less free space than this, new jobs that write under it "
        "(save, save_dir, output_prefix) wait, with a pending_reason naming the root. 0: off.",
    )
    disk_warn_below_bytes: int = Field(
        2**30,
        ge=0,
        description="Low watermark: while a data root has less free space than this, each running job that writes "
        "under it gets a disk_low event (webhook job.disk_low). 0: off.",
    )
    ingest_interval_s: float = Field(0.5, gt=0, description="How often the worker copies run files into the database.")
    database_away_deadline_s: float = Field(
        3600.0,
        gt=0,
        description="How long a worker retries a job's database writes (its launch records, exit and outcome) while "
        "the database is away. Past it a launch is given up (the job is retried) and a finished node's outcome is "
        "parked in its run directory, stored by the worker's heartbeat once the database answers.",
    )
    telemetry_interval_s: float = Field(
        5.0,
        ge=0,
        description="How often workers sample a running job's devices "
        "(utilisation, memory, temperature, power); 0 = off.",
    )
    stream_poll_s: float = Field(1.0, gt=0, description="SSE re-check interval (a fallback when Redis pushes).")
    queue_prefix: str = Field("llmjobs", description="Jobs go to <prefix>.<device_type>; hosts also read host.<name>.")
    worker_name: str = Field(default_factory=socket.gethostname, description="The host name a worker registers.")
    worker_device_type: str = Field(
        "cpu", description="cpu, cuda, npu or auto: the device type of the worker `llmjobs serve` starts."
    )
    worker_devices: int = Field(
        1,
        ge=0,
        description="Devices (CPU: slots) of the worker `llmjobs serve` starts; `llmjobs worker` takes it when set, else "
        "discovers them.",
    )
    worker_concurrency: int = Field(2, ge=1, description="Jobs one worker runs at once.")
    worker_address: str = Field("", description="Address other nodes use to reach this host; default: auto-detected.")
    team_device_limit: int = Field(0, ge=0, description="Devices one team may hold at once; 0 = no limit.")
    team_device_limits: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict, description="Per-team overrides of team_device_limit, e.g. 'research=16,ops=4'."
    )
    team_max_streams: int = Field(
        20, ge=0, description="Open SSE job streams one team may hold on one API replica; past it 429; 0 = no limit."
    )
    team_max_uploads: int = Field(
        4, ge=0, description="File uploads one team may have in progress on one API replica; past it 429; 0 = no limit."
    )
    team_max_chat_requests: int = Field(
        64,
        ge=0,
        description="Chat/completion requests (the OpenAI routes) one team may have in progress on one API replica; "
        "past it 429; 0 = no limit.",
    )
    engine_read_timeout_s: float = Field(
        120.0,
        gt=0,
        description="The OpenAI routes give up on an engine silent this long (before its answer, or between two of "
        "its lines): 503 model_not_ready, or an error event in a stream already started.",
    )
    engine_unhealthy_ttl_s: float = Field(
        10.0,
        ge=0,
        description="An engine that refused a connection or timed out is left out of GET /v1/models, and its "
        "requests answered 503 at once, for this long; then the next request tries it again.",
    )
    team_max_active_jobs: int = Field(
        200,
        ge=0,
        description="Unfinished jobs (queued to cancelling; a pipeline counts once) one team may have; past it a "
        "submission gets 429; 0 = no limit.",
    )
    team_limit_retry_after_s: int = Field(
        5, ge=1, description="The Retry-After (seconds) of a 429 answered past one of the team limits above."
    )
    team_priority_ceiling: int = Field(
        10, ge=-100, le=100, description="The highest job priority a team may set; higher is refused with 422."
    )
    team_priority_ceilings: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict, description="Per-team overrides of team_priority_ceiling, e.g. 'ops=100'."
    )
    body_read_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request body (an upload too) that sends nothing for this long is cut off with 408.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A connection whose request head (line and headers) is not complete this long is closed.",
    )
    retry_exit_codes: Annotated[list[int], NoDecode] = Field(
        default_factory=lambda: [75, 1],
        description="Engine exit codes retried up to max_restarts (2 = bad input is never "
        "retried); a rank killed by a signal or a lost node always is.",
    )
    schedule_window: int = Field(
        50,
        ge=1,
        description="A scheduling pass considers at most this many waiting jobs of each team and gang shape (the "
        "first by priority, then age); later ones are considered as those ahead of them start, and a pass that "
        "starts all of one shape's is followed at once by another. Pending reasons are written for these jobs.",
    )
    schedule_backstop_s: float = Field(
        5.0,
        ge=0,
        description="A host's heartbeat runs a backstop scheduling pass only when no pass has run anywhere for this "
        "long (passes after a submission, a node's end or a worker's start always run).",
    )
    rdzv_port_base: int = Field(29500, ge=1024, le=65000, description="Multi-node rendezvous ports start here ...")
    rdzv_port_count: int = Field(500, ge=1, description="... and the scheduler picks one of this many per job.")
    webhook_poll_s: float = Field(1.0, gt=0, description="How often the API's webhook sender looks for new events.")
    webhook_timeout_s: float = Field(10.0, gt=0, description="One webhook POST may take this long.")
    webhook_max_attempts: int = Field(8, ge=1, description="POSTs of one webhook message before it is given up.")
    webhook_backoff_s: float = Field(5.0, gt=0, description="Retry n waits webhook_backoff_s * 2**(n-1), at most 1 h.")
    webhook_settle_s: float = Field(
        2.0,
        ge=0,
        description="Events are sent once they are this old (longer than any open transaction), so none is skipped.",
    )
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Admin's comma-separated host names, addresses or networks (CIDR) that "
        "webhooks may reach although not public (and over plain http).",
    )
    webhook_max_url_length: int = Field(2048, ge=64, description="Longer webhook URLs are refused.")
    secret_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated Fernet keys for secrets stored encrypted (webhook secrets), "
        "newest first: the first encrypts, all decrypt. Default: one generated into "
        "<var_dir>/secret.key.",
    )
    metadata_max_keys: int = Field(16, ge=0, description="Keys a job's metadata may have.")
    metadata_max_key_length: int = Field(64, ge=1, description="Characters of one metadata key.")
    metadata_max_value_length: int = Field(512, ge=1, description="Characters of one metadata value.")
    metadata_max_bytes: int = Field(8192, ge=1, description="UTF-8 bytes of a job's metadata keys and values together.")
    retention_metric_points_days: float = Field(
        0, ge=0, description="Days a finished job keeps its metric points; 0 = forever."
    )
    retention_log_lines_days: float = Field(
        0, ge=0, description="Days a finished job keeps its log lines; 0 = forever."
    )
    retention_events_days: float = Field(0, ge=0, description="Days a finished job keeps its events; 0 = forever.")
    retention_run_dirs_days: float = Field(
        0, ge=0, description="Days a finished job's run directory is kept; 0 = forever."
    )
    metric_downsample_above: int = Field(
        0,
        ge=0,
        description="A finished job's metric series (name, rank) with more "
        "points than this is thinned to about this many; 0 = never.",
    )
    retention_interval_s: float = Field(
        3600.0, gt=0, description="How often the leading API replica applies retention."
    )
    log_format: Literal["json", "text"] = Field(
        "json", description="Service log lines: JSON objects (with request_id and job_id) or plain text."
    )
    log_level: str = Field("INFO", description="Root log level of the API and worker processes.")
    metrics_listen_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="If set, /metrics is also served without a token "
        "on this port of metrics_listen_host; 0 = only "
        "GET /metrics with an admin token.",
    )
    metrics_listen_host: str = Field("127.0.0.1", description="Address of the metrics_listen_port listener.")
    webhook_max_per_team: int = Field(20, ge=1, description="Enabled webhooks one team may have.")
    max_train_iters: int = Field(
        1_000_000, ge=0, description="Train specs asking more iterations are refused at submission; 0 = no ceiling."
    )
    max_train_tokens: int = Field(
        10**13,
        ge=0,
        description="Train specs whose train_iters × global_batch_size × "
        "seq_length is larger are refused; 0 = no ceiling.",
    )
    default_run_deadline_s: int = Field(
        0, ge=0, description="run_deadline_s given to a job (each pipeline step too) whose spec sets none; 0 = none."
    )
    team_run_deadlines: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict, description="Per-team overrides of default_run_deadline_s, e.g. 'research=86400'."
    )
    slurm_pools: dict[str, SlurmPool] = Field(
        default_factory=dict,
        description="Slurm partitions jobs may run on (resources.pool), as JSON: name -> SlurmPool; see the README's "
        "'Running on a Slurm cluster'. Run by `llmjobs slurm-agent`.",
    )
    slurm_poll_interval_s: float = Field(5.0, gt=0, description="How often the Slurm agent asks squeue/sacct.")

    @field_validator("data_roots", "webhook_allowed_hosts", "secret_keys", "shared_data_areas", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("team_device_limits", "team_run_deadlines", "team_priority_ceilings", mode="before")
    @classmethod
    def _split_limits(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
            if any(len(p) != 2 for p in pairs):
                raise ValueError(f"{info.field_name}: expected 'team=N,team=N'")
            return {k.strip(): int(v) for k, v in pairs}
        return value

    @field_validator("retry_exit_codes", mode="before")
    @classmethod
    def _split_codes(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [int(v) for v in value.split(",") if v.strip()]
        if 2 in value:
            raise ValueError("retry_exit_codes: 2 means bad input and is never retried")
        return value

    def device_limit(self, team: str) -> int:
        """Devices ``team`` may hold at once (0 = unlimited)."""
        return self.team_device_limits.get(team, self.team_device_limit)

    def priority_ceiling(self, team: str) -> int:
        """The highest priority ``team``'s jobs may ask for."""
        return self.team_priority_ceilings.get(team, self.team_priority_ceiling)

    def run_deadline_for(self, team: str) -> int:
        """Default run deadline of ``team``'s jobs in seconds (0 = none)."""
        return self.team_run_deadlines.get(team, self.default_run_deadline_s)

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        self.var_dir = self.var_dir.resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.var_dir / 'llmjobs.db'}"
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{self.var_dir / 'broker.db'}"
        if not self.data_roots:
            self.data_roots = [self.var_dir / "data"]
        self.data_roots = [p.resolve() for p in self.data_roots]
        self.runs_dir = (self.runs_dir or self.var_dir / "runs").resolve()
        return self

    @property
    def runs_path(self) -> Path:
        assert self.runs_dir is not None  # filled by the validator
        return self.runs_dir

    def queue_for(self, device_type: str) -> str:
        return f"{self.queue_prefix}.{device_type}"

    def ensure_dirs(self) -> None:
        """Create the local directories the embedded setup writes to."""
        for path in [self.var_dir, self.runs_path, *self.data_roots]:
            path.mkdir(parents=True, exist_ok=True)


_pinned: list[Settings] = []  # a command's own settings (use_settings), over the environment's


@lru_cache
def _from_environment() -> Settings:
    return Settings()


def get_settings() -> Settings:
    """This process's settings: the environment's, read once, or what a command pinned with ``use_settings``."""
    return _pinned[-1] if _pinned else _from_environment()


def use_settings(settings: Settings) -> None:
    """Make ``settings`` what ``get_settings`` returns in this process (a command's options over the environment's),
    rather than writing them back into ``os.environ``."""
    _pinned[:] = [settings]


def clear_settings() -> None:
    """Forget pinned and cached settings: the next ``get_settings`` reads the environment again."""
    _pinned.clear()
    _from_environment.cache_clear()
