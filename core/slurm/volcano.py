"""Volcano (Kubernetes, e.g. ModelArts on Ascend): the Job the service would create for a pool of kind volcano, and
Volcano's admission rules it must pass. Written and tested here, not submitted yet: no pool setting selects it and
nothing sends it to a cluster (README, "Running on a Slurm cluster").

One task ``worker`` of ``nnodes`` replicas, one pod per node (``minAvailable`` = replicas: gang-scheduled whole),
each running the engine's torchrun line with the c10d rendezvous on pod 0 (the ``svc`` plugin gives every pod a
stable name ``<job>-worker-<i>.<job>``, the task index comes as ``VC_TASK_INDEX``); the NPUs as
``huawei.com/Ascend910`` requests equal to limits; the ``ring-controller.atlas`` label and the rank-table
ConfigMap (``rings-config-<job>``, mounted where Ascend's hccl-controller writes ``hccl.json``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from core.slurm.script import HEAD, NODE_RANK, SLURM_JOB, job_name, shell_word

TASK = "worker"
RANK_TABLE_MOUNT = "/user/serverid/devindex/config"  # where Ascend's hccl-controller puts hccl.json in the pod
# Volcano's lifecycle policies (volcano pkg/webhooks/admission/jobs/validate): the events and actions a Job may use.
POLICY_EVENTS = frozenset({"*", "PodFailed", "PodEvicted", "Unknown", "TaskCompleted", "TaskFailed", "JobUpdated"})
POLICY_ACTIONS = frozenset({"AbortJob", "RestartJob", "RestartTask", "TerminateJob", "CompleteJob", "ResumeJob"})
JOB_PLUGINS = frozenset({"env", "svc", "ssh", "mpi", "pytorch", "tensorflow"})
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
RETRYABLE_EXIT = 75  # engine.contract.runfiles.EXIT_RETRYABLE: the engine asks to be run again


@dataclass(frozen=True)
class VolcanoPool:
    namespace: str
    queue: str
    image: str
    devices_per_node: int
    device_resource: str = "huawei.com/Ascend910"
    ring_controller: str = "ascend-910b"  # the ring-controller.atlas label's value (accelerator kind)
    runs_claim: str = "llmjobs-runs"  # the PersistentVolumeClaim holding the run directories
    runs_mount: str = "/runs"
    rdzv_port: int = 29500


def _env_list(env: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"name": name, "value": value} for name, value in sorted(env.items())]


def manifests(
    pool: VolcanoPool, *, job_id: str, nnodes: int, argv: Sequence[str], env: Mapping[str, str], max_retry: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Volcano Job and its rank-table ConfigMap. ``argv``: the engine's line with ``core.slurm.script``'s
    placeholders (head, node rank, rendezvous id)."""
    name = job_name(job_id)
    head = f"{name}-{TASK}-0.{name}"  # the svc plugin's headless service name of pod 0
    variables = {HEAD: head, NODE_RANK: "${VC_TASK_INDEX}", SLURM_JOB: name}
    command = "exec " + " ".join(shell_word(a, variables) for a in argv)
    labels = {"app": "llmjobs", "llmjobs/job-id": job_id, "ring-controller.atlas": pool.ring_controller}
    devices = {pool.device_resource: str(pool.devices_per_node)}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"rings-config-{name}",
            "namespace": pool.namespace,
            "labels": {"ring-controller.atlas": pool.ring_controller},
        },
        "data": {"hccl.json": '{"status":"initializing"}'},
    }
    job = {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": pool.namespace, "labels": labels},
        "spec": {
            "schedulerName": "volcano",
            "queue": pool.queue,
            "minAvailable": nnodes,
            "maxRetry": max_retry,
            "plugins": {"svc": [], "env": []},
            "policies": [
                {"event": "PodEvicted", "action": "RestartJob"},  # preempted or its node lost
                {"exitCode": RETRYABLE_EXIT, "action": "RestartJob"},
            ],
            "tasks": [
                {
                    "name": TASK,
                    "replicas": nnodes,
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "restartPolicy": "Never",
                            "containers": [
                                {
                                    "name": "engine",
                                    "image": pool.image,
                                    "command": ["/bin/bash", "-c", command],
                                    "env": _env_list(env),
                                    "resources": {"requests": dict(devices), "limits": dict(devices)},
                                    "ports": [{"containerPort": pool.rdzv_port, "name": "rdzv"}],
                                    "volumeMounts": [
                                        {"name": "ascend-910-config", "mountPath": RANK_TABLE_MOUNT},
                                        {"name": "runs", "mountPath": pool.runs_mount},
                                    ],
                                }
                            ],
                            "volumes": [
                                {"name": "ascend-910-config", "configMap": {"name": f"rings-config-{name}"}},
                                {"name": "runs", "persistentVolumeClaim": {"claimName": pool.runs_claim}},
                            ],
                        },
                    },
                }
            ],
        },
    }
    return job, config_map


def _policy_errors(policies: Sequence[Mapping[str, Any]], where: str) -> list[str]:
    errors: list[str] = []
    events: set[str] = set()
    codes: set[int] = set()
    for policy in policies:
        named = [e for e in [policy.get("event"), *(policy.get("events") or [])] if e]
        code = policy.get("exitCode")
        if named and code is not None:
            errors.append(f"{where}: must not specify event and exitCode simultaneously")
        elif not named and code is None:
            errors.append(f"{where}: either event or exitCode must be specified")
        elif named:
            for event in dict.fromkeys(named):
                if event not in POLICY_EVENTS:
                    errors.append(f"{where}: invalid policy event {event!r}")
                if policy.get("action") not in POLICY_ACTIONS:
                    errors.append(f"{where}: invalid policy action {policy.get('action')!r}")
                if event in events:
                    errors.append(f"{where}: duplicate event {event!r} across policies")
                events.add(event)
        elif code == 0:
            errors.append(f"{where}: 0 is not a valid error code")
        elif code in codes:
            errors.append(f"{where}: duplicate exitCode {code}")
        else:
            codes.add(cast(int, code))
    if "*" in events and len(events) > 1:
        errors.append(f"{where}: '*' must be the only event")
    return errors


def _qualified(name: str) -> bool:
    return len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))


def admission_errors(job: Mapping[str, Any]) -> list[str]:
    """What Volcano's Job admission webhook would refuse (its create-time checks that need no cluster: the queue's
    existence and the pod template's Kubernetes validation are not checked here). Empty: admitted."""
    spec, name = job.get("spec") or {}, (job.get("metadata") or {}).get("name", "")
    errors: list[str] = []
    if spec.get("minAvailable", 0) < 0:
        errors.append("job 'minAvailable' must be >= 0")
    if spec.get("maxRetry", 0) < 0:
        errors.append("'maxRetry' cannot be less than zero")
    tasks = spec.get("tasks") or []
    if not tasks:
        return [*errors, "no task specified in job spec"]
    seen: set[str] = set()
    total = 0
    for index, task in enumerate(tasks):
        task_name, replicas = task.get("name", ""), task.get("replicas", 0)
        if replicas < 0:
            errors.append(f"'replicas' < 0 in task {task_name}")
        minimum = task.get("minAvailable")
        if minimum is not None and not 0 <= minimum <= replicas:
            errors.append(f"task {task_name}: 'minAvailable' must be within 0..replicas")
        total += replicas
        if len(task_name) > 63 or not _DNS1123_LABEL.match(task_name):
            errors.append(f"task name {task_name!r} is not a DNS-1123 label")
        if task_name in seen:
            errors.append(f"duplicated task name {task_name}")
        seen.add(task_name)
        errors += _policy_errors(task.get("policies") or [], f"spec.tasks[{index}].policies")
        if not _qualified(f"{name}-{task_name}-{index}"):
            errors.append(f"pod name {name}-{task_name}-{index} is not a qualified name (at most 63 characters)")
    if not _qualified(name):
        errors.append(f"job name {name!r} is not a qualified name")
    if total < spec.get("minAvailable", 0):
        errors.append("job 'minAvailable' should not be greater than total replicas in tasks")
    errors += _policy_errors(spec.get("policies") or [], "spec.policies")
    errors += [f"unable to find job plugin: {p}" for p in spec.get("plugins") or {} if p not in JOB_PLUGINS]
    return errors
