"""The order of the xdist stage of `make test` (applied by tests/conftest.py in each xdist worker)."""

from __future__ import annotations

from pathlib import Path

import pytest


def _expected_length(item: pytest.Item) -> tuple[float, bool]:
    timeout = item.get_closest_marker("timeout")
    seconds = (timeout.args[0] if timeout.args else timeout.kwargs.get("timeout", 0)) if timeout else 0
    return float(seconds), item.get_closest_marker("slow") is not None


def longest_modules_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The modules with a longer timeout mark first, then those with a slow test, then the rest, each module whole.

    Why: the xdist stage ends when its last test does, and a 5-minute test drawn near the end of the random order keeps
    one worker busy while the other has nothing left (longest-first is the classic fix). The sort is stable, so the
    order within each rank of length, and within each module, is still pytest-randomly's (same seed, same order: it
    documents stable sorts on top of its shuffle as reproducible). With the Makefile's `--dist worksteal` each worker
    starts on half of this order and one that runs out takes half of the other's unstarted tests (docs/testing.md)."""
    modules: dict[Path, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    ranked = sorted(modules.values(), key=lambda group: max(map(_expected_length, group)), reverse=True)
    return [item for group in ranked for item in group]
