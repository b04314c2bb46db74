"""Process-group supervision: cancel leaves no process of the job alive, even ones that ignore SIGTERM or left the
group the way torchrun's workers do (start_new_session)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

from worker.launcher import LaunchPlan
from worker.supervisor import Supervised

# A launcher that, like torchrun, starts a worker in a new session; the worker ignores SIGTERM.
TREE = r"""
import signal, subprocess, sys, time
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('worker up', flush=True); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
print("launcher up", flush=True)
time.sleep(600)
"""


def _start(tmp_path: Path, code: str) -> Supervised:
    plan = LaunchPlan(argv=[sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    proc = Supervised(plan, tmp_path / "logs" / "launcher.log")
    deadline = time.monotonic() + 30
    while (tmp_path / "logs" / "launcher.log").read_text().count(" up") < code.count(
        "print("
    ) and time.monotonic() < deadline:
        proc.poll()
        time.sleep(0.05)
    proc.poll()
    return proc


def test_cancel_kills_the_whole_tree(tmp_path: Path) -> None:
    proc = _start(tmp_path, TREE)
    pids = list(proc._seen)
    assert len(pids) == 2, "launcher and worker should both be running"
    started = time.monotonic()
    code = proc.terminate(grace_s=1.0)
    assert code != 0
    assert time.monotonic() - started < 10
    assert proc.survivors() == []
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_stubborn_process_gets_sigkill_after_grace(tmp_path: Path) -> None:
    proc = _start(
        tmp_path,
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('x up', flush=True); time.sleep(600)",
    )
    started = time.monotonic()
    assert proc.terminate(grace_s=0.5) == -9
    assert 0.5 <= time.monotonic() - started < 10
    assert proc.survivors() == []


def test_output_goes_to_the_log_file(tmp_path: Path) -> None:
    proc = Supervised(
        LaunchPlan(
            argv=[sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], env={}, cwd=tmp_path
        ),
        tmp_path / "logs" / "launcher.log",
    )
    assert proc.wait(30) == 0
    assert sorted((tmp_path / "logs" / "launcher.log").read_text().split()) == ["err", "out"]
