"""The job state machine: which transitions exist, and that terminal states never change."""

from __future__ import annotations

import itertools

import pytest

from core.states import (
    ACTIVE,
    ALLOWED_FROM,
    NODE_STARTED,
    RUNNING,
    TERMINAL,
    DeliveryState,
    HostState,
    JobState,
    NodeState,
    can_transition,
    sources,
)


def test_happy_path_is_allowed() -> None:
    path = [JobState.queued, JobState.starting, JobState.running, JobState.succeeded]
    assert all(can_transition(a, b) for a, b in itertools.pairwise(path))


@pytest.mark.parametrize("terminal", sorted(TERMINAL))
@pytest.mark.parametrize("target", list(JobState))
def test_terminal_states_never_change(terminal: JobState, target: JobState) -> None:
    assert terminal.is_terminal()
    assert not can_transition(terminal, target)


def test_cancel_paths() -> None:
    assert can_transition(JobState.queued, JobState.cancelled)  # never started: cancelled at once
    assert can_transition(JobState.running, JobState.cancelling)
    assert can_transition(JobState.cancelling, JobState.cancelled)
    assert not can_transition(JobState.queued, JobState.cancelling)  # nothing to stop yet


def test_retry_path_goes_back_through_starting() -> None:
    assert can_transition(JobState.running, JobState.retrying)
    assert can_transition(JobState.retrying, JobState.starting)
    assert not can_transition(JobState.retrying, JobState.running)


def test_every_state_is_reachable() -> None:
    reachable = {JobState.queued} | {t for t, sources in ALLOWED_FROM.items() if sources}
    assert reachable == set(JobState)


@pytest.mark.parametrize("machine", [JobState, NodeState, HostState, DeliveryState])
def test_no_state_machine_leaves_a_terminal_state(machine: type) -> None:
    for source in machine:
        if source.is_terminal():
            assert not any(can_transition(source, target) for target in machine), source


def test_node_and_delivery_paths() -> None:
    launched = [NodeState.assigned, NodeState.launching, NodeState.running, NodeState.exited]
    assert all(can_transition(a, b) for a, b in itertools.pairwise(launched))
    assert can_transition(NodeState.assigned, NodeState.dropped) and not can_transition(
        NodeState.running, NodeState.dropped
    )
    assert can_transition(NodeState.running, NodeState.lost) and not can_transition(NodeState.exited, NodeState.lost)
    assert sources(NodeState.exited) == ["launching", "running"]
    assert sources(NodeState.lost, only_from=NODE_STARTED) == ["launching", "running"]
    assert can_transition(DeliveryState.pending, DeliveryState.delivered)
    assert not can_transition(DeliveryState.failed, DeliveryState.pending)
    assert can_transition(HostState.up, HostState.down) and can_transition(HostState.down, HostState.up)


def test_running_and_active_sets_are_one_definition() -> None:
    """The worker's "still running" set (no cancel asked) is RUNNING; ACTIVE adds cancelling."""
    assert RUNNING == {JobState.starting, JobState.running}
    assert ACTIVE == RUNNING | {JobState.cancelling}
    assert ALLOWED_FROM[JobState.cancelling] == RUNNING
