"""Admission by trace: for a job using a feature the memory planner has no model of, admission may run
``python -m engine trace`` on the job's spec in a child process, within a time budget, and decide on the traced
peak instead of the planner's (``LLMJOBS_ADMISSION_TRACE_S``; 0, the default: the planner alone). A trace over the
budget, or one that fails, leaves the decision to the planner.

Features the planner has no model of (``trace_features``):

- ``moe_expert_kernel``: MoE layers on ``npu``. The planner models the experts as one gathered grouped matmul
  (``engine.model.gathered_matmul``: the tokens and the row order kept, no gathered rows); where
  ``torch.nn.functional.grouped_mm`` does not run (torch_npu), the engine takes the padded ``bmm`` kernel (every
  expert padded to the busiest one) or the per-expert loop (``engine.model.moe.GroupedExperts``), whose saved
  tensors and padding the planner does not count. The trace runs that kernel at balanced routing.

In the contract (torch-free, what the API and core may import): the child process does the tracing.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.contract.plan.planner import plan_spec
from engine.contract.spec import JobBase, ServeSpec, TrainSpec

ROOT = Path(__file__).resolve().parents[2]  # the repository: ``python -m engine`` runs from it
TRACEABLE_DEVICES = ("npu",)  # cuda needs a CUDA build of torch and a visible GPU (docs/device-trace.md)


@dataclasses.dataclass
class TracedAdmission:
    """The trace's verdict: the largest traced peak of any rank against the device memory."""

    peak_bytes: int
    device_memory_bytes: int
    features: list[str]
    wall_s: float

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.device_memory_bytes

    def message(self) -> str:
        gib = 2**30
        return (
            f"resources: the traced peak of a rank is {self.peak_bytes / gib:.2f} GiB and a device has "
            f"{self.device_memory_bytes / gib:.2f} GiB (traced, not planned: the planner has no model of "
            f"{', '.join(self.features)})"
        )


def trace_features(spec: JobBase) -> list[str]:
    """The features of ``spec`` the planner has no model of (see the module docstring); [] for the others."""
    if not isinstance(spec, TrainSpec | ServeSpec) or spec.resources.device_type not in TRACEABLE_DEVICES:
        return []
    try:
        cfg = plan_spec(spec).cfg
    except ValueError:  # shape unknown before the run: nothing to trace either
        return []
    return ["moe_expert_kernel"] if cfg.moe_layers and spec.resources.device_type == "npu" else []


def admit_by_trace(spec: JobBase, device_memory_bytes: int, budget_s: float) -> TracedAdmission | None:
    """Trace ``spec`` in a child process (``python -m engine trace --spec``) within ``budget_s`` seconds; None when
    it has no feature the planner lacks, runs over the budget or fails (the planner decides then)."""
    features = trace_features(spec)
    if not features or budget_s <= 0:
        return None
    assert isinstance(spec, TrainSpec | ServeSpec)  # trace_features lists none for other kinds
    with tempfile.TemporaryDirectory(prefix="llmjobs-trace-") as tmp:
        path = Path(tmp) / "spec.json"
        # the fields the job gave (defaults given again can be refused: offload fractions without offload)
        path.write_text(json.dumps({**spec.model_dump(mode="json", exclude_unset=True), "kind": spec.kind}))
        command = [sys.executable, "-m", "engine", "trace", "--spec", str(path)]
        command += ["--device-type", spec.resources.device_type, "--data-root", tmp]
        try:
            run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=budget_s, check=False)
        except subprocess.TimeoutExpired:
            return None  # subprocess.run kills the child on its timeout
    if run.returncode:
        return None
    out = json.loads(run.stdout.strip().splitlines()[-1])
    return TracedAdmission(int(out["max_peak_bytes"]), device_memory_bytes, features, float(out["wall_s"]))
