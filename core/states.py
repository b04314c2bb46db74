"""Every state machine of the service: jobs, job nodes, hosts and webhook deliveries.

Each is a str enum (the database stores its value) with its allowed transitions (target -> the states it may be
entered from) and ``is_terminal``. Every transition is one compare-and-set in SQL,
``UPDATE ... SET state = :target WHERE ... AND state IN (sources(target))``: the row count says whether this writer
won, so two writers can never both move a row (``core.jobs.transition``, ``core.nodes.move_nodes``, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import TypeVar


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
WAITING = frozenset({JobState.queued, JobState.retrying})  # no devices held; the scheduler may start it
RUNNING = frozenset({JobState.starting, JobState.running})  # an attempt holds devices and is not being cancelled
ACTIVE = RUNNING | {JobState.cancelling}  # an attempt holds devices

# target -> the states it may be entered from. A terminal state is never a source, so it never changes.
ALLOWED_FROM: dict[JobState, frozenset[JobState]] = {
    JobState.queued: frozenset({JobState.retrying}),
    JobState.starting: WAITING,
    JobState.running: frozenset({JobState.starting}),
    JobState.cancelling: RUNNING,
    JobState.retrying: RUNNING,
    JobState.succeeded: ACTIVE,
    JobState.failed: WAITING | ACTIVE,
    JobState.cancelled: WAITING | ACTIVE,
}


class NodeState(str, Enum):
    """One node (one host's share) of one job attempt: a ``job_nodes`` row."""

    assigned = "assigned"  # devices leased, the "run node" message sent
    launching = "launching"  # a worker claimed it and is starting torchrun
    running = "running"  # torchrun runs
    exited = "exited"  # torchrun exited (exit_code says how)
    dropped = "dropped"  # never launched: its attempt ended first
    lost = "lost"  # its host or worker died while it ran

    def is_terminal(self) -> bool:
        return self in NODE_TERMINAL


NODE_TERMINAL = frozenset({NodeState.exited, NodeState.dropped, NodeState.lost})
NODE_STARTED = frozenset({NodeState.launching, NodeState.running})  # a process may exist
NODE_ACTIVE = NODE_STARTED | {NodeState.assigned}
NODE_ALLOWED_FROM: dict[NodeState, frozenset[NodeState]] = {
    NodeState.assigned: frozenset(),  # only ever inserted
    NodeState.launching: frozenset({NodeState.assigned}),
    NodeState.running: frozenset({NodeState.launching}),
    NodeState.exited: NODE_STARTED,
    NodeState.dropped: frozenset({NodeState.assigned}),
    NodeState.lost: NODE_ACTIVE,
}


class HostState(str, Enum):
    """A registered worker host. Neither state is terminal: a host comes back when its worker starts again."""

    up = "up"
    down = "down"

    def is_terminal(self) -> bool:
        return False


HOST_ALLOWED_FROM: dict[HostState, frozenset[HostState]] = {
    HostState.up: frozenset({HostState.up, HostState.down}),  # a heartbeat re-stamps an up host
    HostState.down: frozenset({HostState.up}),
}


class DeliveryState(str, Enum):
    """One webhook message to one endpoint, POSTed until a 2xx answer or ``webhook_max_attempts``."""

    pending = "pending"
    delivered = "delivered"
    failed = "failed"

    def is_terminal(self) -> bool:
        return self is not DeliveryState.pending


DELIVERY_ALLOWED_FROM: dict[DeliveryState, frozenset[DeliveryState]] = {
    DeliveryState.pending: frozenset({DeliveryState.pending}),  # an attempt failed; retried later
    DeliveryState.delivered: frozenset({DeliveryState.pending}),
    DeliveryState.failed: frozenset({DeliveryState.pending}),
}

S = TypeVar("S", JobState, NodeState, HostState, DeliveryState)
_TABLES: Mapping[type[Enum], Mapping] = {
    JobState: ALLOWED_FROM,
    NodeState: NODE_ALLOWED_FROM,
    HostState: HOST_ALLOWED_FROM,
    DeliveryState: DELIVERY_ALLOWED_FROM,
}


def allowed_from(target: S) -> frozenset[S]:
    """The states ``target`` may be entered from."""
    table: Mapping[S, frozenset[S]] = _TABLES[type(target)]
    return table[target]


def can_transition(source: S, target: S) -> bool:
    return source in allowed_from(target)


def sources(target: S, only_from: Iterable[S] | None = None) -> list[str]:
    """The stored values a compare-and-set to ``target`` may match (narrowed to ``only_from`` when given)."""
    allowed = allowed_from(target)
    return sorted(s.value for s in allowed if only_from is None or s in set(only_from))
