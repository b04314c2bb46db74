"""The job state machine. Every transition is a compare-and-set in SQL (``core.jobs.transition``)."""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    queued = "queued"
    starting = "starting"
    running = "running"
    cancelling = "cancelling"
    retrying = "retrying"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    def is_terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled})
ACTIVE = frozenset({JobState.starting, JobState.running, JobState.cancelling})
WAITING = frozenset({JobState.queued, JobState.retrying})

# target -> the states it may be entered from. A terminal state is never a source, so it never changes.
ALLOWED_FROM: dict[JobState, frozenset[JobState]] = {
    JobState.queued: frozenset({JobState.retrying}),
    JobState.starting: WAITING,
    JobState.running: frozenset({JobState.starting}),
    JobState.cancelling: frozenset({JobState.starting, JobState.running}),
    JobState.retrying: frozenset({JobState.starting, JobState.running}),
    JobState.succeeded: frozenset({JobState.starting, JobState.running, JobState.cancelling}),
    JobState.failed: WAITING | ACTIVE,
    JobState.cancelled: WAITING | ACTIVE,
}


def can_transition(source: JobState, target: JobState) -> bool:
    return source in ALLOWED_FROM[target]
