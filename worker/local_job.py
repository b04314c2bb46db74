"""One non-pipeline job in the foreground (no server or database): supervise the engine, echo its events and metrics."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from engine.contract.runfiles import read_result
from engine.contract.spec import JobBase, load_spec_file, spec_to_json
from worker.execute import log_tail, write_spec
from worker.ingest import FileTail
from worker.launcher import build_launch
from worker.supervisor import Supervised

CANCEL_GRACE_S = 10.0
INTERRUPTED = 130


def _format_metrics(record: dict[str, Any]) -> str:
    values = " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in (record.get("metrics") or {}).items()
    )
    return f"step {record.get('step')}: {values}"


def _echo_new(tails: dict[str, FileTail], out: TextIO, final: bool = False) -> None:
    for name, tail in tails.items():
        lines, tail.offset = tail.read_lines(final)
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            text = (
                _format_metrics(record) if name == "metrics" else f"[{record.get('type')}] {record.get('message', '')}"
            )
            print(text, file=out, flush=True)


def prepare_run(spec_file: Path, run_dir: Path | None, runs_root: Path, out: TextIO) -> tuple[JobBase, Path]:
    """Parse the spec (pydantic ValidationError when it is bad) and write it into its run directory."""
    spec = load_spec_file(spec_file)
    run_dir = (run_dir or runs_root / f"local-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    write_spec(run_dir, spec_to_json(spec))
    print(f"run directory: {run_dir}", file=out, flush=True)
    return spec, run_dir


def run_job(spec: JobBase, run_dir: Path, out: TextIO = sys.stderr) -> int:
    """Run the job to completion, printing events and metrics; returns the engine's exit code."""
    tails = {"events": FileTail(run_dir / "events.jsonl"), "metrics": FileTail(run_dir / "metrics.jsonl")}
    proc = Supervised(build_launch(spec, run_dir, job_id=run_dir.name), run_dir / "logs" / "launcher.log")
    try:
        while (code := proc.poll()) is None:
            _echo_new(tails, out)
            time.sleep(0.3)
        proc.wait()
    except KeyboardInterrupt:
        code = proc.terminate(CANCEL_GRACE_S)
        print("cancelled", file=out)
        return INTERRUPTED
    _echo_new(tails, out, final=True)
    result = read_result(run_dir)
    if code == 0 and result is not None:
        print(json.dumps(result, indent=2, ensure_ascii=False), flush=True)
    else:
        print(f"failed with exit code {code}; last log lines:\n{log_tail(run_dir)}", file=out, flush=True)
    return code
