"""Slurm pools' pure parts: the sbatch script, the state table, the squeue/sacct parsers, admission against a pool."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from core.errors import ApiError
from core.settings import Settings, SlurmPool
from core.slurm.pools import check_pool_fits, check_pool_memory
from core.slurm.queue import parse_sacct, parse_squeue
from core.slurm.script import REQUEUE_REQUEST, render, sbatch_options
from core.slurm.states import FINAL, SLURM_STATES, Outcome, is_final, outcome
from core.slurm.tracker import SlurmRow
from engine.contract.spec import Resources, parse_spec
from engine.train.preempt import REQUEUE_REQUEST as ENGINE_REQUEUE_REQUEST
from train_support import QWEN3_4B, tiny_spec
from worker.slurm_agent import engine_command

NPU_POOL = SlurmPool(
    partition="ascend",
    gres_per_node="npu:910B3:8",
    devices_per_node=8,
    device_type="npu",
    device_memory_gib=64,
    host_memory_gib=1024,
    account="llm",
    qos="high",
    time_limit="2-00:00:00",
    max_nodes=4,
    extra_sbatch=["--exclusive"],
    constraint="910b",
    python="/shared/venv/bin/python",
)


def _row(tmp_path: Path, spec: dict[str, Any]) -> SlurmRow:
    return SlurmRow("job-1", "queued", 0, None, None, str(tmp_path / "run"), "default", spec, None)


def test_sbatch_lines_are_sorted_and_carry_the_pool(tmp_path: Path) -> None:
    options = sbatch_options(NPU_POOL, job_id="job-1", nnodes=2, run_dir=tmp_path)
    assert options == sorted(options)
    for wanted in (
        "--job-name=llmjobs-job-1",
        "--partition=ascend",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gres=npu:910B3:8",
        "--signal=USR2@90",
        "--requeue",
        "--account=llm",
        "--qos=high",
        "--time=2-00:00:00",
        "--constraint=910b",
        "--mem=1048576M",
        "--exclusive",
        "--export=NONE",
    ):
        assert wanted in options
    no_requeue = NPU_POOL.model_copy(update={"requeue": False})
    assert "--no-requeue" in sbatch_options(no_requeue, job_id="j", nnodes=1, run_dir=tmp_path)


def test_multi_node_script_runs_the_workers_torchrun_line_under_srun(tmp_path: Path) -> None:
    settings = Settings(var_dir=tmp_path, slurm_pools={"ascend": NPU_POOL})
    spec = tiny_spec(
        "d", resources={"pool": "ascend", "device_type": "npu", "nnodes": 2, "nproc_per_node": 8}, global_batch_size=32
    )
    row = _row(tmp_path, spec)
    argv, env = engine_command(settings, row)
    script = render(NPU_POOL, job_id=row.job_id, nnodes=2, run_dir=Path(row.run_dir), argv=argv, env=env)
    srun = next(line for line in script.splitlines() if line.startswith("    /shared/venv/bin/python"))
    assert "-m torch.distributed.run --nproc-per-node 8 --nnodes 2" in srun
    assert '--rdzv-endpoint "${LLMJOBS_HEAD}:29500"' in srun
    assert '--rdzv-id "${SLURM_JOB_ID}"' in srun and '--node-rank "${SLURM_NODEID}"' in srun
    assert srun.endswith(f"-m engine train --spec {row.run_dir}/spec.json --run-dir {row.run_dir}")
    assert f"--output={row.run_dir}/logs/launcher-node%t.log" in script
    assert "export LLMJOBS_JOB_ID=job-1" in script and "DATABASE_URL" not in script
    assert REQUEUE_REQUEST == ENGINE_REQUEUE_REQUEST  # the engine's request is what the script looks for
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, check=False)
    assert syntax.returncode == 0, syntax.stderr


def test_one_node_script_is_standalone_with_one_log(tmp_path: Path) -> None:
    pool = SlurmPool(partition="debug", devices_per_node=2)
    settings = Settings(var_dir=tmp_path, slurm_pools={"debug": pool})
    row = _row(tmp_path, tiny_spec("d", resources={"pool": "debug", "nproc_per_node": 2}))
    argv, env = engine_command(settings, row)
    script = render(pool, job_id="job-1", nnodes=1, run_dir=Path(row.run_dir), argv=argv, env=env)
    assert "--standalone" in script and "--rdzv-id" not in script
    assert f"--output={row.run_dir}/logs/launcher.log" in script


def test_state_table() -> None:
    assert outcome("PENDING") is Outcome.waiting
    assert outcome("RUNNING") is Outcome.running
    assert outcome("COMPLETED") is Outcome.succeeded
    for failed in ("FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT"):
        assert outcome(failed) is Outcome.failed and is_final(failed)
    assert outcome("CANCELLED by 0") is Outcome.cancelled and is_final("CANCELLED by 0")
    for again in ("PREEMPTED", "REQUEUED"):
        assert outcome(again) is Outcome.retrying and not is_final(again)
    assert outcome("SOMETHING_NEW") is Outcome.running  # asked again next interval, never ended on a guess
    assert FINAL == {s for s, o in SLURM_STATES.items() if o in (Outcome.succeeded, Outcome.failed, Outcome.cancelled)}


def test_squeue_parser_reads_the_wait_status() -> None:
    text = "41|COMPLETED|0|vm|None|\n42|FAILED|768|vm|NonZeroExitCode|\n43|PENDING|0||Resources|\n44|CANCELLED|15|vm|None|\n"
    jobs = parse_squeue(text)
    assert jobs["42"].exit_code == 3 and jobs["42"].signal is None and jobs["42"].reason == "NonZeroExitCode"
    assert jobs["43"].state == "PENDING" and jobs["43"].nodes == "" and jobs["43"].reason == "Resources"
    assert jobs["44"].signal == 15


def test_sacct_parser_skips_steps_and_keeps_the_latest_row() -> None:
    text = "7|REQUEUED|0:0|n1|None\n7.batch|CANCELLED|0:15|n1|\n7|RUNNING|0:0|n2|None\n8|CANCELLED by 0|0:15|n3|None\n"
    jobs = parse_sacct(text)
    assert set(jobs) == {"7", "8"}
    assert jobs["7"].state == "RUNNING" and jobs["7"].nodes == "n2"
    assert jobs["8"].exit_code == 0 and jobs["8"].signal == 15


@pytest.mark.parametrize(
    ("resources", "words"),
    [
        ({"pool": "nowhere"}, "no Slurm pool 'nowhere'"),
        ({"pool": "ascend", "device_type": "cuda"}, "has npu devices"),
        ({"pool": "ascend", "device_type": "npu", "nproc_per_node": 16}, "16 devices per node"),
        ({"pool": "ascend", "device_type": "npu", "nnodes": 5}, "at most 4"),
    ],
)
def test_pool_refuses_what_it_cannot_run(tmp_path: Path, resources: dict[str, Any], words: str) -> None:
    settings = Settings(var_dir=tmp_path, slurm_pools={"ascend": NPU_POOL})
    with pytest.raises(ApiError) as caught:
        check_pool_fits(settings, Resources(**resources))
    assert caught.value.status == 422 and caught.value.field == "resources.pool"
    assert words in caught.value.message


def test_pool_memory_is_the_planners(tmp_path: Path) -> None:
    small, large = (NPU_POOL.model_copy(update={"device_memory_gib": gib}) for gib in (64, 512))
    spec = tiny_spec("d", resources={"pool": "ascend", "device_type": "npu", "nproc_per_node": 1}, **QWEN3_4B)
    spec.update(micro_batch_size=1, global_batch_size=1, seq_length=4096)
    parsed = parse_spec(spec)
    check_pool_memory(Settings(var_dir=tmp_path, slurm_pools={"ascend": large}), parsed)  # ~88 GiB a rank: fits
    with pytest.raises(ApiError) as caught:
        check_pool_memory(Settings(var_dir=tmp_path, slurm_pools={"ascend": small}), parsed)
    assert caught.value.status == 422 and caught.value.code == "does_not_fit"
    assert caught.value.field == "micro_batch_size" and "(pool 'ascend')" in caught.value.message
