"""What the API answers, as typed dictionaries (the JSON as it arrives: times are ISO 8601 strings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})


class JobError(TypedDict):
    code: str
    message: str | None
    log_tail: str | None


class Job(TypedDict):
    object: str
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
    slurm_job_id: str | None
    slurm_state: str | None
    run_dir: str
    created_at: str
    updated_at: str
    started_at: str | None
    finished_at: str | None
    heartbeat_at: str | None
    steps: list[dict[str, Any]] | None
    trained_tokens: int | None
    iteration: int | None
    estimated_finish: str | None


class JobDeleted(TypedDict):
    object: str
    id: str
    deleted: bool
    removed: list[str]


class Page(TypedDict):
    """One cursor page of a list: pass ``last_id`` as ``after`` for the next one."""

    object: str
    data: list[Any]
    has_more: bool
    first_id: str | int | None
    last_id: str | int | None


class Event(TypedDict):
    id: int
    attempt: int | None
    time: str
    type: str
    level: str
    message: str
    data: dict[str, Any]


class MetricPoint(TypedDict):
    id: int
    step: int
    name: str
    value: float | None
    rank: int | None
    time: str
    attempt: int | None


class LogLine(TypedDict):
    id: int
    stream: str
    seq: int
    text: str
    time: str


class Artifact(TypedDict):
    name: str
    path: str
    size_bytes: int | None
    files: list[str]
    created_at: str
    download_url: str | None


class Checkpoint(TypedDict):
    object: str
    iteration: int
    format: str
    model_path: str
    optimizer_path: str | None
    lora: bool
    needs_base_model: bool
    evaluable: bool
    convertible: bool
    metrics: dict[str, float | None]
    reference: dict[str, Any]


class File(TypedDict):
    object: str
    path: str
    server_path: str
    size_bytes: int
    modified_at: str
    sha256: str | None


class FileDeleted(TypedDict):
    object: str
    path: str
    deleted: bool


@dataclass(frozen=True)
class StreamMessage:
    """One message of a job's live stream: ``event`` is state, event, metric, log or end; ``id`` resumes after it."""

    event: str
    data: dict[str, Any]
    id: str | None
