"""Spec -> command line and environment of the engine process. Pure: no I/O, unit-tested."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.contract.spec import JobBase

REPO_ROOT = Path(__file__).resolve().parents[1]
VISIBLE_DEVICES_VAR = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of a multi-node job meet; node 0's address. Single-node jobs use torchrun --standalone."""

    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node_rank: int = 0


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    cwd: Path


def engine_args(kind: str, run_dir: Path) -> list[str]:
    return ["-m", "engine", kind, "--spec", str(run_dir / "spec.json"), "--run-dir", str(run_dir)]


def build_launch(
    spec: JobBase,
    run_dir: Path,
    *,
    job_id: str = "",
    python: str = sys.executable,
    base_env: Mapping[str, str] | None = None,
    devices: Sequence[int] | None = None,
    rendezvous: Rendezvous | None = None,
) -> LaunchPlan:
    """``python -m engine <kind>``, or ``torchrun`` when the spec asks for more than one process."""
    kind: str = spec.kind  # type: ignore[attr-defined]
    res = spec.resources
    if res.world_size == 1:
        argv = [python, *engine_args(kind, run_dir)]
    else:
        argv = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(res.nproc_per_node)]
        if res.nnodes == 1:
            argv += ["--standalone", "--nnodes", "1"]
        else:
            rdzv = rendezvous or Rendezvous()
            argv += [
                "--nnodes",
                str(res.nnodes),
                "--node-rank",
                str(rdzv.node_rank),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"{rdzv.master_addr}:{rdzv.master_port}",
                "--rdzv-id",
                job_id or "llmjobs",
            ]
        argv += engine_args(kind, run_dir)
    return LaunchPlan(
        argv=argv, env=build_env(spec, job_id=job_id, run_dir=run_dir, base_env=base_env, devices=devices), cwd=run_dir
    )


def build_env(
    spec: JobBase,
    *,
    job_id: str,
    run_dir: Path,
    base_env: Mapping[str, str] | None = None,
    devices: Sequence[int] | None = None,
) -> dict[str, str]:
    env = dict(os.environ if base_env is None else base_env)
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach launcher.log (and the database) as they are written
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["LLMJOBS_JOB_ID"] = job_id
    env["LLMJOBS_RUN_DIR"] = str(run_dir)
    device_type = spec.resources.device_type
    if device_type == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # N ranks x all cores each would oversubscribe the host
    elif devices is not None:
        env[VISIBLE_DEVICES_VAR[device_type]] = ",".join(str(d) for d in devices)
    return env
