"""A process tied to its launcher dies when the launcher is SIGKILLed, whatever the launcher's signal handlers do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

# A "launcher" that ignores SIGTERM (as a torchrun whose handler got swallowed would) and starts a "rank" in a
# session of its own, as torchrun does; the rank ties itself to the launcher the way engine.cli does.
_LAUNCHER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(rank.pid, flush=True)
time.sleep(600)
"""
_RANK = """
import os, time
os.environ["TORCHELASTIC_RUN_ID"] = "t"
from engine.contract.parent_death import die_with_launcher
die_with_launcher()
open(os.environ["READY"], "w").close()
time.sleep(600)
"""


def _gone(pid: int, timeout: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    return True


def test_a_rank_dies_with_its_sigkilled_launcher(tmp_path) -> None:
    ready = tmp_path / "ready"
    env = {**os.environ, "READY": str(ready)}
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _RANK], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert launcher.stdout is not None
        rank = int(launcher.stdout.readline())
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the rank never started"
        launcher.send_signal(signal.SIGTERM)  # ignored: the rank must live on
        assert not _gone(rank, 0.5)
        launcher.kill()
        launcher.wait()
        assert _gone(rank, 10), "the rank outlived its launcher"
    finally:
        launcher.kill()


def test_outside_torchrun_nothing_is_tied(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.contract import parent_death

    calls: list[tuple[int, ...]] = []
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(parent_death, "_prctl", lambda *args: calls.append(args) or 0)
    parent_death.die_with_launcher()
    assert calls == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    parent_death.die_with_launcher()
    assert calls == [(1, signal.SIGKILL)]
