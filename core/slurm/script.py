"""The sbatch script of a Slurm pool's job: sorted ``#SBATCH`` lines, the job's environment, one ``srun`` task per
node running the engine's own command line (``worker.launcher.build_launch``) under torchrun's c10d rendezvous.

The command line comes in with placeholders (``HEAD``, ``NODE_RANK``, ``SLURM_JOB``) that become shell variables:
the head node is known only once Slurm allocated the nodes (``scontrol show hostnames``). torchrun ignores USR2
(the ``trap '' USR2`` before ``exec`` is inherited), so Slurm's warning (``--signal=USR2@90``) reaches the engine's
ranks, which save a checkpoint and exit ``EXIT_RETRYABLE``; the script then asks Slurm to requeue the job, which
resumes from that checkpoint.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from core.settings import SlurmPool
from engine.contract.runfiles import EXIT_RETRYABLE

HEAD = "@@LLMJOBS_HEAD@@"  # the first allocated node's name
NODE_RANK = "@@SLURM_NODEID@@"
SLURM_JOB = "@@SLURM_JOB_ID@@"
_VARIABLES = {HEAD: "${LLMJOBS_HEAD}", NODE_RANK: "${SLURM_NODEID}", SLURM_JOB: "${SLURM_JOB_ID}"}
WARNING_SIGNAL = "USR2@90"  # USR1 is NCCL's
REQUEUE_REQUEST = "requeue.request"  # engine.train.preempt.REQUEUE_REQUEST: the ranks saved and ask for a requeue


def job_name(job_id: str) -> str:
    return f"llmjobs-{job_id}"


def shell_word(arg: str, variables: Mapping[str, str] = _VARIABLES) -> str:
    """One shell word: literal text quoted, the placeholders replaced by ``variables`` (shell expansions)."""
    if not any(p in arg for p in variables):
        return shlex.quote(arg)
    out = arg.replace('"', '\\"').replace("$", "\\$").replace("`", "\\`")
    for placeholder, variable in variables.items():
        out = out.replace(placeholder, variable)
    return f'"{out}"'


def sbatch_options(pool: SlurmPool, *, job_id: str, nnodes: int, run_dir: Path) -> list[str]:
    """The ``#SBATCH`` options, sorted (a stable script for the same job)."""
    options = [
        f"--job-name={job_name(job_id)}",
        f"--partition={pool.partition}",
        f"--nodes={nnodes}",
        "--ntasks-per-node=1",  # one torchrun per node; it starts the node's ranks
        f"--signal={WARNING_SIGNAL}",
        "--requeue" if pool.requeue else "--no-requeue",
        "--export=NONE",  # the service's environment (database URL, secrets) stays out of the job
        "--open-mode=append",  # a requeued run appends: the ingested offsets stay valid
        f"--output={run_dir / 'logs' / 'slurm-batch.log'}",
        f"--chdir={run_dir}",
    ]
    optional = {
        "gres": pool.gres_per_node,
        "account": pool.account,
        "qos": pool.qos,
        "time": pool.time_limit,
        "constraint": pool.constraint,
        "mem": f"{int(pool.host_memory_gib * 1024)}M" if pool.host_memory_gib else None,
    }
    options += [f"--{name}={value}" for name, value in optional.items() if value]
    options += [line.strip() for line in pool.extra_sbatch if line.strip()]
    return sorted(options)


def render(
    pool: SlurmPool,
    *,
    job_id: str,
    nnodes: int,
    run_dir: Path,
    argv: Sequence[str],
    env: Mapping[str, str],
) -> str:
    """The whole script. ``argv`` is the engine's command line with the placeholders; ``env`` the job's
    environment (only these variables are exported, with ``PATH``)."""
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {option}" for option in sbatch_options(pool, job_id=job_id, nnodes=nnodes, run_dir=run_dir)]
    lines += ["set -u"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    task_log = run_dir / "logs" / ("launcher.log" if nnodes == 1 else "launcher-node%t.log")
    request = shlex.quote(str(run_dir / REQUEUE_REQUEST))
    requeue = (
        [
            f'if [ "$code" -eq {EXIT_RETRYABLE} ] || [ -e {request} ]; then',
            '    echo "llmjobs: the engine saved a checkpoint and asks for a requeue"',
            f"    rm -f {request}",
            '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
            "fi",
        ]
        if pool.requeue
        else [f"rm -f {request}"]
    )
    lines += [
        "export SLURM_EXPORT_ENV=ALL  # srun hands this script's environment to its tasks",
        'LLMJOBS_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export LLMJOBS_HEAD",
        'echo "llmjobs: Slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, restart ${SLURM_RESTART_COUNT:-0}"',
        f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 --open-mode=append --output={shlex.quote(str(task_log))} \\",
        '    bash -c \'trap "" USR2; exec "$@"\' llmjobs-engine \\',
        "    " + " ".join(shell_word(a) for a in argv),
        "code=$?",
        *requeue,
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"
