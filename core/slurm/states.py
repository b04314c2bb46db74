"""Slurm's job states and what each means for the job (``core.states.JobState``).

| Slurm state | the job |
|---|---|
| PENDING, REQUEUE_HOLD, SUSPENDED | queued (retrying stays retrying), Slurm's reason as ``pending_reason`` |
| CONFIGURING | starting |
| RUNNING, COMPLETING, STAGE_OUT, SIGNALING, RESIZING | running |
| COMPLETED | succeeded (with the engine's result.json; failed ``no_result`` without) |
| FAILED, NODE_FAIL, OUT_OF_MEMORY, TIMEOUT, BOOT_FAIL, DEADLINE, SPECIAL_EXIT, REVOKED, STOPPED | failed, with the reason |
| CANCELLED (also ``CANCELLED by <uid>``) | cancelled |
| PREEMPTED, REQUEUED, REQUEUE_FED | retrying (Slurm runs it again; the engine resumes from its checkpoint) |

A state not in the table is taken as still running (the tracker asks again next interval).
"""

from __future__ import annotations

from enum import Enum


class Outcome(str, Enum):
    waiting = "waiting"
    starting = "starting"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    retrying = "retrying"


SLURM_STATES: dict[str, Outcome] = {
    "PENDING": Outcome.waiting,
    "REQUEUE_HOLD": Outcome.waiting,
    "SUSPENDED": Outcome.waiting,
    "CONFIGURING": Outcome.starting,
    "RUNNING": Outcome.running,
    "COMPLETING": Outcome.running,
    "STAGE_OUT": Outcome.running,
    "SIGNALING": Outcome.running,
    "RESIZING": Outcome.running,
    "COMPLETED": Outcome.succeeded,
    "FAILED": Outcome.failed,
    "NODE_FAIL": Outcome.failed,
    "OUT_OF_MEMORY": Outcome.failed,
    "TIMEOUT": Outcome.failed,
    "BOOT_FAIL": Outcome.failed,
    "DEADLINE": Outcome.failed,
    "SPECIAL_EXIT": Outcome.failed,
    "REVOKED": Outcome.failed,
    "STOPPED": Outcome.failed,
    "CANCELLED": Outcome.cancelled,
    "PREEMPTED": Outcome.retrying,
    "REQUEUED": Outcome.retrying,
    "REQUEUE_FED": Outcome.retrying,
}
FINAL = frozenset(s for s, o in SLURM_STATES.items() if o in (Outcome.succeeded, Outcome.failed, Outcome.cancelled))


def outcome(state: str) -> Outcome:
    """The job's side of a Slurm state; ``CANCELLED by 0`` (sacct) is CANCELLED."""
    return SLURM_STATES.get(base_state(state), Outcome.running)


def base_state(state: str) -> str:
    return state.split(" ", 1)[0].strip().upper()


def is_final(state: str) -> bool:
    return base_state(state) in FINAL
