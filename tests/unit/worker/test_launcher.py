"""Spec -> engine command line and environment."""

from __future__ import annotations

from pathlib import Path

from engine.contract.spec import parse_spec
from worker.launcher import Rendezvous, build_launch

RUN = Path("/runs/job1")


def _spec(**resources: object):  # noqa: ANN202
    return parse_spec(
        {
            "kind": "preprocess",
            "input": "in.jsonl",
            "tokenizer_name_or_path": "tok",
            "output_prefix": "out",
            "resources": resources,
        }
    )


def test_one_process_runs_the_engine_directly() -> None:
    plan = build_launch(_spec(), RUN, job_id="job1", python="/py", base_env={})
    assert plan.argv == [
        "/py",
        "-m",
        "engine",
        "preprocess",
        "--spec",
        "/runs/job1/spec.json",
        "--run-dir",
        "/runs/job1",
    ]
    assert plan.cwd == RUN
    assert plan.env["PYTHONUNBUFFERED"] == "1"
    assert plan.env["LLMJOBS_JOB_ID"] == "job1"
    assert plan.env["OMP_NUM_THREADS"] == "1"


def test_several_processes_go_through_torchrun_standalone() -> None:
    plan = build_launch(_spec(nproc_per_node=4), RUN, python="/py", base_env={})
    assert plan.argv[:3] == ["/py", "-m", "torch.distributed.run"]
    assert plan.argv[3:8] == ["--nproc-per-node", "4", "--standalone", "--nnodes", "1"]
    assert plan.argv[-7:] == ["-m", "engine", "preprocess", "--spec", "/runs/job1/spec.json", "--run-dir", "/runs/job1"]


def test_multi_node_uses_c10d_rendezvous() -> None:
    plan = build_launch(
        _spec(nnodes=2, nproc_per_node=8, device_type="npu"),
        RUN,
        job_id="j",
        rendezvous=Rendezvous("10.0.0.1", 29400, node_rank=1),
        base_env={},
        devices=range(8),
    )
    argv = " ".join(plan.argv)
    assert "--nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id j" in argv
    assert plan.env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "OMP_NUM_THREADS" not in plan.env


def test_environment_is_inherited_and_user_threads_respected() -> None:
    plan = build_launch(_spec(), RUN, base_env={"OMP_NUM_THREADS": "4", "HOME": "/h", "PYTHONPATH": "/extra"})
    assert plan.env["OMP_NUM_THREADS"] == "4"
    assert plan.env["HOME"] == "/h"
    assert plan.env["PYTHONPATH"].endswith("/extra")


def test_cuda_devices_are_made_visible() -> None:
    plan = build_launch(_spec(device_type="cuda", nproc_per_node=2), RUN, base_env={}, devices=[2, 3])
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "2,3"
