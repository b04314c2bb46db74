"""``llmjobs run SPEC``: one job or pipeline in the foreground, no server or database, the same run directory a
worker writes.

This is how a platform that runs one container per task uses llmjobs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from engine.contract.spec import PipelineSpec
from worker.local_job import prepare_run, run_job
from worker.pipeline_run import run_pipeline


def run_foreground(spec_file: Path, run_dir: Path | None, runs_root: Path, out: TextIO = sys.stderr) -> int:
    """Run the spec to completion, printing events and metrics; returns the exit code (the engine's for a job)."""
    spec, run_dir = prepare_run(spec_file, run_dir, runs_root, out)
    if isinstance(spec, PipelineSpec):  # its steps, one after another, each in <run_dir>/<step>/
        return run_pipeline(spec, run_dir, runs_root, out)
    return run_job(spec, run_dir, out)
