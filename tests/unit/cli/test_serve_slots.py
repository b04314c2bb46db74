"""`make run` (``llmjobs serve``) starts a CPU worker with room for a deployment, a training job and an eval of the
deployment side by side; LLMJOBS_WORKER_DEVICES still decides when set."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.service import SERVE_CPU_SLOTS, worker_argv, worker_devices
from core.settings import Settings


def _devices(argv: list[str]) -> int:
    return int(argv[argv.index("--devices") + 1])


def test_serve_gives_a_cpu_worker_three_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMJOBS_WORKER_DEVICES", raising=False)
    settings = Settings(var_dir=tmp_path)
    assert SERVE_CPU_SLOTS >= 3 and _devices(worker_argv(settings)) == SERVE_CPU_SLOTS


def test_the_setting_decides_when_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMJOBS_WORKER_DEVICES", "1")
    assert worker_devices(Settings(var_dir=tmp_path)) == 1
    monkeypatch.delenv("LLMJOBS_WORKER_DEVICES")
    assert worker_devices(Settings(var_dir=tmp_path, worker_device_type="cuda")) == 1  # accelerators: as set
