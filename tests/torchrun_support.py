"""Shared helpers of the multi-process tests (not a test module): the one way a test starts ranks under torchrun.

``torchrun(n, target...)`` is the command (``target``: a worker script and its argv, or ``-m engine ...``); ``run_ok``
runs a command with one thread per rank and the repository importable, and asserts it exited 0 (the failure shows
the tails of both streams); ``launch_worker`` runs a worker script whose rank 0 writes its JSON result to the file
named by its first argument (the worker side: ``gloo_worker_support.run_ranks``); ``main_in_process`` is the one-rank
``python -m engine`` in the test's own process.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, *target: str) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=nproc target...``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *target]


def run_ok(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` from the repository root (``OMP_NUM_THREADS=1``, the repository on ``PYTHONPATH``); it must
    exit 0 within ``timeout`` seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def launch_worker(worker: Path, nproc: int, out: Path, *args: str, timeout: float = 300) -> Any:
    """Run ``worker OUT args...`` on ``nproc`` ranks; what its rank 0 wrote to ``out``."""
    run_ok(torchrun(nproc, str(worker), str(out), *args), timeout=timeout)
    return json.loads(out.read_text())


def main_in_process(argv: list[str], run_dir: Path) -> None:
    """``python -m engine <argv>`` on one process, in this one: the CLI's own main without a fresh interpreter's
    imports (most of a short run's time), on one intra-op thread like the ranks' OMP_NUM_THREADS=1. The CLI points
    the root logger at the run's files; pytest's handlers are put back after."""
    import torch

    from engine.cli import main

    root = logging.getLogger()
    handlers, level, threads = list(root.handlers), root.level, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(argv)
    finally:
        torch.set_num_threads(threads)
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    log = run_dir / "logs" / "rank0.log"
    assert code == 0, log.read_text()[-4000:] if log.is_file() else f"exit {code}"
