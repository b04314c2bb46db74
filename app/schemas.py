"""API response schemas (pydantic), kept apart from the ORM tables. Request bodies are the specs in engine/contract/spec/."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")


class FromRow(BaseModel):
    """A response built from an ORM row (``model_validate(row)``): every ``*Public`` model that reads a table."""

    model_config = ConfigDict(from_attributes=True)


class ErrorItem(BaseModel):
    code: str = Field(description="machine-readable reason, e.g. validation_error, missing, extra_forbidden")
    message: str = Field(description="what is wrong, starting with the field's name when there is one")
    field: str | None = Field(description="the offending field (dotted path), header or query parameter")


class ErrorBody(ErrorItem):
    """Every error answer of the API (4xx and 5xx)."""

    errors: list[ErrorItem] | None = Field(None, description="422: every problem found (the first is repeated above)")


class JobError(BaseModel):
    code: str
    message: str | None = None
    log_tail: str | None = None


class PipelineStepPublic(BaseModel):
    name: str
    kind: str
    state: str = Field(description="the step's job state, or pending (not submitted yet) / skipped (will not run)")
    job_id: str | None = Field(description="the child job (parent_id = the pipeline); null while pending or skipped")
    reason: str | None = Field(None, description="why it is skipped, or why its job still waits")


class JobPublic(BaseModel):
    object: Literal["job"] = "job"
    id: str
    team: str
    kind: str
    name: str | None
    state: str
    spec: dict[str, Any]
    metadata: dict[str, Any]
    priority: int
    parent_id: str | None
    attempt_count: int
    max_restarts: int
    pending_reason: str | None
    error: JobError | None
    result: dict[str, Any] | None
    host: str | None
    slurm_job_id: str | None = Field(None, description="a Slurm pool's job (spec.resources.pool): its Slurm job id")
    slurm_state: str | None = Field(None, description="a Slurm pool's job: the last Slurm state the agent read")
    run_dir: str
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    heartbeat_at: datetime | None
    steps: list[PipelineStepPublic] | None = Field(None, description="pipelines: their steps, in order (GET one job)")
    trained_tokens: int | None = Field(
        None,
        description="train jobs: real (non-padding) tokens trained on so far, from the per-iteration tokens metric",
    )
    iteration: int | None = Field(
        None, description="train jobs: the last iteration trained so far (of spec.train_iters), from the metrics"
    )
    estimated_finish: datetime | None = Field(
        None,
        description="train jobs: when the last iteration should end, extrapolated from the iterations done since start",
    )

    @classmethod
    def from_row(cls, job: Any) -> JobPublic:
        error = (
            JobError(code=job.error_code, message=job.error_message, log_tail=job.error_log_tail)
            if job.error_code
            else None
        )
        fields = {
            name: getattr(job, name)
            for name in cls.model_fields
            if name not in {"object", "metadata", "error", "steps", "trained_tokens", "iteration", "estimated_finish"}
        }
        return cls(**fields, metadata=job.meta or {}, error=error)


class JobDeleted(BaseModel):
    object: Literal["job.deleted"] = "job.deleted"
    id: str
    deleted: bool
    removed: list[str] = Field(
        description="the run directories (and with outputs=true the output files and directories) removed from disk"
    )


class ListPage(BaseModel, Generic[T]):
    """A cursor page, as OpenAI's lists: pass ``last_id`` as ``after`` for the next page."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | int | None = None
    last_id: str | int | None = None

    @classmethod
    def of(
        cls,
        data: list[T],
        has_more: bool = False,
        key: Callable[[T], str | int] = lambda item: item.id,  # type: ignore[attr-defined]
    ) -> ListPage[T]:
        """The page of ``data``, its first and last ids read with ``key``."""
        return cls(
            data=data,
            has_more=has_more,
            first_id=key(data[0]) if data else None,
            last_id=key(data[-1]) if data else None,
        )


class EventPublic(FromRow):
    id: int
    attempt: int | None
    time: datetime
    type: str
    level: str
    message: str
    data: dict[str, Any]


class MetricPointPublic(FromRow):
    id: int
    step: int
    name: str
    value: float | None = Field(description="null when the value was NaN or infinite")
    rank: int | None = Field(description="null for a job-wide value, else the rank it was measured on")
    time: datetime
    attempt: int | None = Field(None, description="the attempt that measured it (null before the first started)")


class MetricsPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[MetricPointPublic]
    has_more: bool
    next_since_step: int | None = Field(
        description="pass as since_step for the next page (older clients; a step "
        "larger than limit loses rows: use next_cursor)"
    )
    next_cursor: str | None = Field(
        None,
        description="pass as after for the next page: it starts right after the "
        "last point of this one, so no row is skipped whatever limit",
    )


class LogLinePublic(FromRow):
    id: int
    stream: str
    seq: int
    text: str
    time: datetime


class LogsPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[LogLinePublic]
    has_more: bool
    next_offset: int = Field(description="pass as offset for the next page")


class ArtifactPublic(FromRow):
    name: str
    path: str
    size_bytes: int | None
    files: list[str]
    created_at: datetime
    download_url: str | None = Field(None, description="GET it for the file, or a tar of the directory/file set")


class CheckpointPublic(BaseModel):
    object: Literal["checkpoint"] = "checkpoint"
    iteration: int
    format: Literal["training_state", "mcore"] = Field(
        description="training_state: <save>/train_state/iter_* (DCP, resumable); mcore: the final Megatron export"
    )
    model_path: str
    optimizer_path: str | None = Field(description="where the optimizer state is, if it was saved")
    lora: bool = Field(description="it holds LoRA adapters (read from its tensors)")
    needs_base_model: bool = Field(
        description="adapters only, no base weights: by reference as load, the run's base becomes load and this "
        "lora_load"
    )
    evaluable: bool
    convertible: bool
    metrics: dict[str, float | None] = Field(description="lm_loss, val_lm_loss, grad_norm at this iteration")
    reference: dict[str, Any] = Field(
        description="{job, iteration, format}: this checkpoint by reference (one per entry; without format the final "
        "export is meant)"
    )


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = Field(default_factory=dict)


class JobLatest(BaseModel):
    job_id: str
    step: int | None = Field(description="the last step with any metric point (null before the first)")
    values: dict[str, float | None] = Field(description="the last job-wide value of each asked metric that has one")
    value_steps: dict[str, int] = Field(description="the step of each value")
    progress: dict[str, Any] | None = Field(description="the data of the job's last progress event")
    devices: dict[int, dict[str, float | None]] | None = Field(
        None, description="with devices=true: each device's newest telemetry (sys_* metrics) by device index"
    )


class JobLatestList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobLatest]


class FileDeleted(BaseModel):
    object: Literal["file.deleted"] = "file.deleted"
    path: str = Field(description="relative to your team's upload area")
    deleted: bool


class FilePublic(BaseModel):
    object: Literal["file"] = "file"
    path: str = Field(description="relative to your team's upload area (what PUT /v1/files/{path} named)")
    server_path: str = Field(description="the file on the server, inside the data roots: name it in a job spec")
    size_bytes: int
    modified_at: datetime
    sha256: str | None = Field(None, description="the upload's SHA-256 (hex), in the answer to the upload itself")
