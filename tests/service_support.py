"""Starting the service the way `make run` does (`llmjobs serve` on a free port with its own var dir), for e2e tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from core.settings import REPO_ROOT


@dataclass
class Service:
    url: str
    token: str
    var: Path
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_command() -> list[str]:
    script = Path(sys.executable).parent / "llmjobs"  # what `make run` runs
    return [str(script), "serve"] if script.exists() else [sys.executable, "-m", "cli.main", "serve"]


@contextmanager
def serve(var: Path, **settings: str) -> Iterator[Service]:
    """Run `llmjobs serve` with only ``LLMJOBS_VAR_DIR``, a free port and ``settings`` (environment variables) set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMJOBS_")}
    env.update(LLMJOBS_VAR_DIR=str(var), LLMJOBS_PORT=str(free_port()), **settings)
    log = var / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _serve_command(), env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{env['LLMJOBS_PORT']}"
    try:
        _wait_ready(url, var, proc, log)
        yield Service(url, (var / "admin_token").read_text().strip(), var, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_ready(url: str, var: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"llmjobs serve exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200 and (var / "admin_token").exists():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"service not ready:\n{log.read_text()[-3000:]}")
