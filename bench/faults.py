"""Fault figures: a worker SIGKILLed mid-training, N times, against one uninterrupted run of the same job.

Each run: a tiny two-rank CPU train job (``tests/integration/sched_support.py``'s spec) on a real `llmjobs worker`,
checkpointing every ``--save-interval`` iterations; once it has checkpointed the worker is SIGKILLed, the host stops
heart-beating, the reconciler re-queues the job, a new worker comes up on the same host and the job resumes from its
checkpoint. Reported as one JSON line: runs, how many resumed (``resumed_from`` set, attempt 2) and succeeded, how
many ended with ``final_lm_loss`` equal to the uninterrupted run's (exactly, and within ``--tolerance``), and the
wall time. The mechanics are those of ``tests/integration/test_recovery_sigkill.py``.

    python bench/faults.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "integration")]

from core.settings import Settings  # noqa: E402
from core_support import isolated_settings, team_dir  # noqa: E402
from sched_support import (  # noqa: E402
    checkpoints,
    reconciler,
    start_worker,
    stop_worker,
    submit,
    train_spec,
    wait_for,
    wait_terminal,
    write_tiny_data,
)


def one_run(settings: Settings, spec: dict[str, Any], log: Path, kill: bool) -> dict[str, Any]:
    worker = start_worker(settings, "h1", 2, log)
    try:
        job_id = submit(settings, spec)
        if kill:
            wait_for(settings, job_id, lambda r: checkpoints(settings, job_id) >= 1, 600, "checkpointed")
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
            wait_for(settings, job_id, lambda r: r.state == "retrying", 120, "re-queued")
            worker = start_worker(settings, "h1", 2, log)  # the host comes back
        row = wait_terminal(settings, job_id, 1200)
    finally:
        stop_worker(worker)
    summary = (row.result or {}).get("summary") or {}
    return {"state": row.state, "attempts": row.attempt_count, "resumed": bool(summary.get("resumed_from")),
            "final_lm_loss": summary.get("final_lm_loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="SIGKILLed runs (default 2; the issue asks for 20)")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=1e-6, help="relative loss difference counted as equal")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmjobs-faults-") as tmp:
        root = Path(tmp)
        settings = isolated_settings(root / "var", heartbeat_interval_s=1, host_stale_after_s=6, ingest_interval_s=0.3)
        area = team_dir(settings, "t")  # the submitting team's data area (sched_support.submit submits as "t")
        data = write_tiny_data(area / "tiny")

        def spec(name: str) -> dict[str, Any]:
            return train_spec(data, train_iters=args.iters, save_interval=args.save_interval, max_restarts=2,
                              save=str(area / name), resources={"nproc_per_node": 2})

        with reconciler(settings):
            baseline = one_run(settings, spec("baseline"), root / "worker.log", kill=False)
            runs = [one_run(settings, spec(f"run{i}"), root / "worker.log", kill=True) for i in range(args.runs)]
    base = baseline["final_lm_loss"]

    def close(loss: float | None) -> bool:
        return loss is not None and base is not None and abs(loss - base) <= args.tolerance * max(abs(base), 1e-12)

    print(json.dumps({
        "runs": args.runs, "iters": args.iters, "save_interval": args.save_interval,
        "baseline_state": baseline["state"], "baseline_final_lm_loss": base,
        "resumed": sum(r["resumed"] and r["attempts"] == 2 for r in runs),
        "succeeded": sum(r["state"] == "succeeded" for r in runs),
        "final_loss_equal": sum(r["final_lm_loss"] == base for r in runs),
        "final_loss_within_tolerance": sum(close(r["final_lm_loss"]) for r in runs),
        "final_lm_losses": [r["final_lm_loss"] for r in runs],
        "wall_s": round(time.monotonic() - started, 1),
    }))


if __name__ == "__main__":
    main()
