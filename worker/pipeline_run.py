"""``llmjobs run pipeline.json``: a pipeline's steps one after another in the foreground, with no server or database.

The same decisions as the service's driver (``core.pipelines.decide``): each step runs as ``llmjobs run`` runs a job,
in ``<run>/<step>/``, its ``${steps.<name>.outputs.<key>}`` replaced from the earlier steps' result.json, and
``on_failure`` is honoured. The pipeline's own result.json lists every step and every output as ``<step>.<key>``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

from pydantic import ValidationError

from core.pipelines import StepError, child_body, decide
from core.states import JobState
from engine.contract.runfiles import read_result
from engine.contract.spec import PipelineSpec, first_error
from worker.local_job import INTERRUPTED, prepare_run, run_job


@dataclass
class StepRun:
    """What ``decide`` reads of a step's job, for a step run in the foreground."""

    id: str
    state: str
    result: dict[str, Any] | None
    error_message: str | None = None
    error_code: str | None = None
    pending_reason: str | None = None


def run_step(
    spec: PipelineSpec, index: int, body: dict[str, Any], run_dir: Path, runs_root: Path, out: TextIO
) -> StepRun:
    name = spec.steps[index].name
    spec_file = run_dir / f"{name}.spec.json"
    spec_file.write_text(json.dumps(body, indent=2))
    print(f"== step {index + 1}/{len(spec.steps)}: {name} ({body['kind']})", file=out, flush=True)
    try:
        step_spec, step_dir = prepare_run(spec_file, run_dir / name, runs_root, out)
        code = run_job(step_spec, step_dir, out)
    except ValidationError as err:
        raise StepError(first_error(err, f"steps.{index}.spec")) from None
    result = read_result(run_dir / name) if code == 0 else None
    state = JobState.succeeded.value if result is not None else JobState.failed.value
    return StepRun(str(run_dir / name), state, result, error_message=None if result else f"exit code {code}")


def run_pipeline(spec: PipelineSpec, run_dir: Path, runs_root: Path, out: TextIO = sys.stderr) -> int:
    """Run every step; exit code 0 if the pipeline succeeded, 1 if a step failed, 2 for a bad step spec."""
    runs: dict[str, StepRun] = {}
    parent = SimpleNamespace(meta=dict(spec.metadata), priority=spec.priority, name=spec.name)
    while (decision := decide(spec, runs)).action == "create":
        step = spec.steps[decision.index]
        try:
            body = child_body(parent, spec, decision.index, decision.outputs)
            runs[step.name] = run_step(spec, decision.index, body, run_dir, runs_root, out)
        except StepError as err:
            print(f"error: {err}", file=out, flush=True)
            return 2
        if runs[step.name].error_message == f"exit code {INTERRUPTED}":
            print("pipeline cancelled", file=out, flush=True)
            return INTERRUPTED
    outputs = {f"{name}.{key}": value for name, out_ in decision.outputs.items() for key, value in out_.items()}
    result = {
        "kind": "pipeline",
        "outputs": outputs,
        "summary": {"steps": [v.public() for v in decision.views], "error": decision.error},
    }
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2, ensure_ascii=False), flush=True)
    return 0 if decision.state is JobState.succeeded else 1
