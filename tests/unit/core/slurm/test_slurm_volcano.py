"""The Volcano Job a pool of kind volcano would get, checked against Volcano's admission rules (not submitted here)."""

from __future__ import annotations

import copy
import subprocess
from typing import Any

import pytest

from core.slurm.script import HEAD, NODE_RANK, SLURM_JOB
from core.slurm.volcano import VolcanoPool, admission_errors, manifests

POOL = VolcanoPool(namespace="llm", queue="train", image="registry.local/llmjobs:latest", devices_per_node=8)
JOB_ID = "0b9c51a2-6a8e-4d1f-9a55-2f1d3c7e9b10"
ARGV = [
    "/opt/venv/bin/python",
    "-m",
    "torch.distributed.run",
    "--nproc-per-node",
    "8",
    "--nnodes",
    "4",
    "--node-rank",
    NODE_RANK,
    "--rdzv-backend",
    "c10d",
    "--rdzv-endpoint",
    f"{HEAD}:29500",
    "--rdzv-id",
    SLURM_JOB,
    "-m",
    "engine",
    "train",
    "--spec",
    f"/runs/{JOB_ID}/spec.json",
]


def _job(nnodes: int = 4) -> tuple[dict[str, Any], dict[str, Any]]:
    return manifests(POOL, job_id=JOB_ID, nnodes=nnodes, argv=ARGV, env={"LLMJOBS_JOB_ID": JOB_ID}, max_retry=2)


@pytest.mark.parametrize("nnodes", [1, 4, 64])
def test_the_job_passes_volcano_admission(nnodes: int) -> None:
    job, config_map = _job(nnodes)
    assert admission_errors(job) == []
    spec = job["spec"]
    (task,) = spec["tasks"]
    assert spec["minAvailable"] == task["replicas"] == nnodes  # gang: all pods or none
    container = task["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"] == container["resources"]["limits"] == {"huawei.com/Ascend910": "8"}
    assert job["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
    assert task["template"]["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
    assert config_map["metadata"]["name"] == f"rings-config-llmjobs-{JOB_ID}"
    assert config_map["metadata"]["labels"] == {"ring-controller.atlas": "ascend-910b"}
    mounted = {v["name"]: v for v in task["template"]["spec"]["volumes"]}
    assert mounted["ascend-910-config"]["configMap"]["name"] == config_map["metadata"]["name"]


def test_the_command_meets_at_pod_zero() -> None:
    job, _ = _job()
    command = job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["/bin/bash", "-c"]
    name = f"llmjobs-{JOB_ID}"
    assert f'--rdzv-endpoint "{name}-worker-0.{name}:29500"' in command[2]
    assert '--node-rank "${VC_TASK_INDEX}"' in command[2] and f'--rdzv-id "{name}"' in command[2]
    syntax = subprocess.run(["bash", "-n", "-c", command[2]], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, syntax.stderr


def _broken(change: Any) -> list[str]:
    job, _ = _job()
    job = copy.deepcopy(job)
    change(job["spec"])
    return admission_errors(job)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda s: s.update(minAvailable=5), "should not be greater than total replicas"),
        (lambda s: s.update(minAvailable=-1), "must be >= 0"),
        (lambda s: s["tasks"].append(copy.deepcopy(s["tasks"][0])), "duplicated task name worker"),
        (lambda s: s["tasks"][0].update(name="Worker_0"), "not a DNS-1123 label"),
        (lambda s: s["tasks"][0].update(minAvailable=9), "'minAvailable' must be within"),
        (lambda s: s["policies"].append({"event": "PodRunning", "action": "RestartJob"}), "invalid policy event"),
        (lambda s: s["policies"].append({"event": "TaskFailed", "action": "Reboot"}), "invalid policy action"),
        (lambda s: s["policies"].append({"event": "PodEvicted", "action": "AbortJob"}), "duplicate event"),
        (lambda s: s["policies"].append({"event": "*", "action": "AbortJob"}), "'*' must be the only event"),
        (lambda s: s["policies"].append({"exitCode": 0, "action": "AbortJob"}), "0 is not a valid error code"),
        (lambda s: s["policies"].append({"event": "PodFailed", "exitCode": 3, "action": "AbortJob"}), "simultaneously"),
        (lambda s: s["plugins"].update(hccl=[]), "unable to find job plugin: hccl"),
        (lambda s: s.update(tasks=[]), "no task specified"),
    ],
)
def test_volcano_refuses_what_its_webhook_refuses(change: Any, words: str) -> None:
    errors = _broken(change)
    assert any(words in e for e in errors), errors
