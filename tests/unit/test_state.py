"""The job state machine: which transitions exist, and that terminal states never change."""

from __future__ import annotations

import itertools

import pytest

from core.states import ALLOWED_FROM, TERMINAL, JobState, can_transition


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
