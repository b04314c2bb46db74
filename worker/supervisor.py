"""Run the engine in its own process group and stop the whole tree on cancel: SIGTERM, a grace period, SIGKILL.

torchrun starts its workers in new sessions (torch's SubprocessHandler uses start_new_session), so signalling the
group alone misses them: the supervisor also remembers every descendant it has seen and signals those by pid. If the
worker itself dies, the kernel kills the launch (``engine.contract.parent_death``) and each rank dies with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from engine.contract.parent_death import preexec_die_with_parent
from worker.launcher import LaunchPlan


class Supervised:
    """One engine process (and its descendants) writing its output to ``log_path``."""

    def __init__(self, plan: LaunchPlan, log_path: Path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - the child writes to it until wait() closes it
        self.proc = subprocess.Popen(
            plan.argv,
            env=plan.env,
            cwd=plan.cwd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # SIGKILL, not SIGTERM: a killed worker's launch must not outlive it whatever its handlers do
            preexec_fn=preexec_die_with_parent(signal.SIGKILL),  # noqa: PLW1509 - only prctl, no lock
        )
        self.pid = self.proc.pid
        self._seen: dict[int, psutil.Process] = {}
        self.snapshot()

    def snapshot(self) -> None:
        """Remember the current process tree, so descendants that changed session can still be found and killed."""
        try:
            root = psutil.Process(self.pid)
            for proc in [root, *root.children(recursive=True)]:
                self._seen.setdefault(proc.pid, proc)
        except psutil.NoSuchProcess:
            pass

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is None:
            self.snapshot()
        return code

    def wait(self, timeout: float | None = None) -> int:
        code = self.proc.wait(timeout)
        self._log.close()
        return code

    def survivors(self) -> list[int]:
        """Pids of this job's processes still alive (zombies count as gone)."""
        alive = []
        for pid, proc in self._seen.items():
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                continue
        return alive

    def _signal_all(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.survivors():
            try:
                self._seen[pid].send_signal(sig)
            except psutil.NoSuchProcess:
                continue

    def terminate(self, grace_s: float) -> int:
        """SIGTERM the tree, wait up to ``grace_s``, SIGKILL what is left; returns the exit code. Nothing survives."""
        self.snapshot()
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.proc.poll() is None or self.survivors()):
            self.snapshot()
            time.sleep(0.05)
        if self.proc.poll() is None or self.survivors():
            self._signal_all(signal.SIGKILL)
        code = self.wait()
        psutil.wait_procs([self._seen[p] for p in self.survivors()], timeout=5)
        return code
