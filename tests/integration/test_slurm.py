"""Slurm pools against the real one-node Slurm ``scripts/slurm-setup.sh`` starts (``.ci/run`` runs it first).

The service (``llmjobs serve``) takes the jobs; ``llmjobs slurm-agent`` submits them with sbatch and follows them
through squeue (this Slurm has no accounting database, so sacct answers an error and squeue serves). Skipped with
the reason when Slurm is not here or its controller does not answer; a failure under LLMJOBS_REQUIRE_SERVICES=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from convert_tiny import REAL_VOCAB_FLAGS, real_vocab_qwen3
from core.settings import REPO_ROOT
from service_support import Service, free_port, seed_chain_steps, serve, team_area
from train_support import tiny_spec, write_instruction_data

pytestmark = [pytest.mark.slow]
TEAM_AREA = Path("data") / "teams" / "default"


def _slurm_answers() -> str | None:
    """Why Slurm cannot serve the tests, or None."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "Slurm is not installed (no sinfo/sbatch): run scripts/slurm-setup.sh as root"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return "the Slurm controller did not answer `scontrol ping` within 20 s"
    if "UP" not in ping.stdout:
        return f"the Slurm controller is not up (scontrol ping: {ping.stdout.strip() or ping.stderr.strip()})"
    nodes = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20, check=False)
    if not any(s.strip("*~#") in ("idle", "mixed", "allocated", "completing") for s in nodes.stdout.split()):
        return f"no Slurm node is up (sinfo: {nodes.stdout.strip()})"
    return None


@pytest.fixture(scope="module")
def slurm() -> None:
    reason = _slurm_answers()
    if reason is None:
        return
    if os.environ.get("LLMJOBS_REQUIRE_SERVICES") == "1":
        pytest.fail(reason + " (LLMJOBS_REQUIRE_SERVICES=1)")
    pytest.skip(reason)


def _failing_python(var: Path) -> str:
    """An 'engine interpreter' that exits 7: the pool whose jobs fail with a known exit code."""
    path = var / "exit7.sh"
    path.write_text("#!/bin/sh\necho 'engine: failing on purpose' >&2\nexit 7\n")
    path.chmod(0o755)
    return str(path)


def _partition() -> str:
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, check=True).stdout.split()
    return next((p.rstrip("*") for p in out if p.endswith("*")), out[0].rstrip("*"))


@pytest.fixture(scope="module")
def pools(slurm: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    var = tmp_path_factory.mktemp("slurm-var")
    partition = _partition()
    return {
        "var": var,
        "pools": {
            "local": {"partition": partition, "devices_per_node": 2, "device_type": "cpu", "time_limit": "10:00"},
            "broken": {"partition": partition, "devices_per_node": 2, "python": _failing_python(var)},
            # scripts/slurm-setup.sh's two NodeNames on this host (a slurmd each)
            "two": {"partition": "two", "devices_per_node": 1, "max_nodes": 2, "rdzv_port": free_port()},
        },
    }


def _agent(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    script = Path(sys.executable).parent / "llmjobs"
    argv = [str(script), "slurm-agent"] if script.exists() else [sys.executable, "-m", "cli.main", "slurm-agent"]
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Stack:
    """The service and the agent, with what the tests need to restart the agent."""

    def __init__(self, service: Service, env: dict[str, str]):
        self.service, self.env = service, env
        self.agent_log = service.var / "slurm-agent.log"
        self.agent = _agent(env, self.agent_log)

    def restart_agent(self) -> None:
        """SIGKILL the agent (no goodbye) and start another."""
        os.killpg(self.agent.pid, signal.SIGKILL)
        self.agent.wait()
        self.agent = _agent(self.env, self.agent_log)


@pytest.fixture(scope="module")
def stack(pools: dict[str, Any]) -> Iterator[Stack]:
    var: Path = pools["var"]
    settings = {
        "LLMJOBS_SLURM_POOLS": json.dumps(pools["pools"]),
        "LLMJOBS_SLURM_POLL_INTERVAL_S": "1",
        "LLMJOBS_RECONCILE_INTERVAL_S": "1",
        "LLMJOBS_HEARTBEAT_INTERVAL_S": "1",
    }
    with serve(var, **settings) as service:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMJOBS_")}
        env.update(LLMJOBS_VAR_DIR=str(var), **settings)
        write_instruction_data(var / TEAM_AREA / "tiny" / "data")
        stack = Stack(service, env)
        try:
            yield stack
        finally:
            _stop(stack.agent)


def _launcher_log(job: dict[str, Any]) -> str:
    """The tail of srun's output of the job's one task (what a failure message should show)."""
    path = Path(job["run_dir"]) / "logs" / "launcher.log"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def _wait(client: httpx.Client, job_id: str, done: Any, stack: Stack, timeout: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if done(job):
            return job
        if time.monotonic() > deadline:
            raise AssertionError(
                f"job {job_id} stuck in {job['state']} ({job.get('slurm_state')}, {job.get('pending_reason')}):\n"
                f"{stack.agent_log.read_text()[-3000:]}"
            )
        time.sleep(0.5)


def _squeue(slurm_job_id: str) -> tuple[str, str]:
    """(name, state) of a Slurm job as squeue lists it (finished jobs too, for MinJobAge)."""
    out = subprocess.run(
        ["squeue", "-h", "--states=all", "-j", slurm_job_id, "-o", "%j|%T"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    name, _, state = out.partition("|")
    return name, state


def _submit(client: httpx.Client, spec: dict[str, Any]) -> str:
    answer = client.post("/v1/jobs", json=spec)
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def test_train_job_runs_in_slurm_and_streams_its_loss(stack: Stack) -> None:
    spec = tiny_spec("tiny/data", resources={"pool": "local", "nproc_per_node": 2}, train_iters=6)
    with stack.service.client() as client:
        job_id = _submit(client, spec)
        job = _wait(client, job_id, lambda j: j["slurm_job_id"], stack, timeout=60)
        name, _ = _squeue(job["slurm_job_id"])
        assert name == f"llmjobs-{job_id}"
        job = _wait(client, job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), stack)
        assert job["state"] == "succeeded", job
        assert job["slurm_state"] == "COMPLETED"
        assert _squeue(job["slurm_job_id"]) == (f"llmjobs-{job_id}", "COMPLETED")
        points = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "lm_loss"}).json()["data"]
        steps = sorted({p["step"] for p in points if p["rank"] is None})
        assert steps == [1, 2, 3, 4, 5, 6], points
        events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
        states = [e["data"]["state"] for e in events if e["type"] == "state"]
        assert states[-3:] == ["starting", "running", "succeeded"] or states[-2:] == ["starting", "succeeded"]
        assert (Path(job["run_dir"]) / "logs" / "launcher.log").exists()  # srun's output of the one task
    assert (Path(job["run_dir"]) / "slurm.sbatch").read_text().count("#SBATCH --job-name=llmjobs-") == 1


def test_cancel_ends_the_slurm_job_cancelled(stack: Stack) -> None:
    spec = tiny_spec("tiny/data", resources={"pool": "local", "nproc_per_node": 1}, train_iters=100_000)
    with stack.service.client() as client:
        job_id = _submit(client, spec)
        job = _wait(client, job_id, lambda j: j["state"] == "running", stack, timeout=120)
        answer = client.post(f"/v1/jobs/{job_id}/cancel")
        assert answer.status_code == 202, answer.text
        job = _wait(client, job_id, lambda j: j["state"] == "cancelled", stack, timeout=90)
        assert job["slurm_state"] == "CANCELLED"  # settled only once Slurm ended it
        assert _squeue(job["slurm_job_id"])[1] == "CANCELLED"
        events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
        assert [e["data"]["state"] for e in events if e["type"] == "state"][-2:] == ["cancelling", "cancelled"]


def test_failing_job_fails_with_its_exit_code(stack: Stack) -> None:
    spec = tiny_spec("tiny/data", resources={"pool": "broken", "nproc_per_node": 1})
    with stack.service.client() as client:
        job_id = _submit(client, spec)
        job = _wait(client, job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), stack, timeout=120)
        assert job["state"] == "failed", job
        assert job["slurm_state"] == "FAILED"
        assert job["error"]["code"] == "slurm_failed"
        assert "exit code 7" in job["error"]["message"]
        assert "failing on purpose" in (job["error"]["log_tail"] or "")


def test_a_pool_refuses_what_it_cannot_run(stack: Stack) -> None:
    with stack.service.client() as client:
        too_wide = client.post(
            "/v1/jobs", json=tiny_spec("tiny/data", resources={"pool": "local", "nproc_per_node": 4})
        )
        unknown = client.post("/v1/jobs", json=tiny_spec("tiny/data", resources={"pool": "nowhere"}))
    for answer in (too_wide, unknown):
        assert answer.status_code == 422, answer.text
        assert answer.json()["field"] == "resources.pool", answer.text


def test_usr2_saves_requeues_and_resumes(stack: Stack) -> None:
    """Slurm's warning (``--signal=USR2@90``, sent here at once with scancel): the ranks save, the job is requeued
    in Slurm (retrying in the API) and its second run resumes from that checkpoint and succeeds."""
    spec = tiny_spec("tiny/data", resources={"pool": "local", "nproc_per_node": 2}, train_iters=60, max_restarts=2)
    with stack.service.client() as client:
        job_id = _submit(client, spec)
        job = _wait(client, job_id, lambda j: j["state"] == "running", stack, timeout=120)
        deadline = time.monotonic() + 120
        while not client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "lm_loss"}).json()["data"]:
            assert time.monotonic() < deadline, "no loss before the signal"
            time.sleep(0.3)
        subprocess.run(["scancel", "--signal=USR2", job["slurm_job_id"]], check=True)
        _wait(client, job_id, lambda j: j["state"] in ("retrying", "queued") or j["attempt_count"] > 1, stack)
        # Slurm holds a requeued job back about two minutes (its begin time); let it start in a few seconds: slurmd
        # refuses a credential made in the same second as the old run's revocation ("Killing non-startable batch
        # JobId=…: Job credential revoked" in slurmctld.log, the job FAILED; seen with StartTime=now)
        subprocess.run(["scontrol", "update", f"JobId={job['slurm_job_id']}", "StartTime=now+3"], check=False)
        job = _wait(client, job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), stack, timeout=400)
        events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
        said = [(e["type"], e["message"]) for e in events]
        assert job["state"] == "succeeded", json.dumps({"job": job, "events": said, "log": _launcher_log(job)})
        assert job["attempt_count"] == 2
    states = [e["data"]["state"] for e in events if e["type"] == "state"]
    assert "retrying" in states, states
    saved = [e["data"]["iteration"] for e in events if e["type"] == "checkpoint"]
    assert saved, events
    summary = job["result"]["summary"]
    assert summary["start_iteration"] == saved[0] > 0
    assert summary["iterations"] == 60


def test_agent_killed_mid_job_loses_and_repeats_nothing(stack: Stack) -> None:
    """The agent holds nothing Slurm and the database do not: a new one re-reads both and ingests the run files from
    where the old one stored them (``slurm-ingest.json``), so every loss point is stored exactly once."""
    spec = tiny_spec("tiny/data", resources={"pool": "local", "nproc_per_node": 1}, train_iters=80)
    with stack.service.client() as client:
        job_id = _submit(client, spec)
        _wait(client, job_id, lambda j: j["state"] == "running", stack, timeout=120)
        deadline = time.monotonic() + 120
        while not client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "lm_loss"}).json()["data"]:
            assert time.monotonic() < deadline, "no loss before the restart"
            time.sleep(0.2)
        assert _squeue(client.get(f"/v1/jobs/{job_id}").json()["slurm_job_id"])[1] == "RUNNING"  # mid-job
        stack.restart_agent()
        job = _wait(client, job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), stack)
        assert job["state"] == "succeeded", job
        assert job["attempt_count"] == 1
    with sqlite3.connect(stack.service.var / "llmjobs.db") as db:
        steps = [
            row[0]
            for row in db.execute(
                "SELECT step FROM metric_points WHERE job_id = ? AND name = 'lm_loss' AND rank IS NULL ORDER BY step",
                (job_id,),
            )
        ]
    assert steps == list(range(1, 81))


def test_preprocess_job_runs_in_slurm(stack: Stack) -> None:
    """The README's demo preprocess job (its data is what ``llmjobs serve`` puts in the team area), on the pool."""
    text = (REPO_ROOT / "README.md").read_text()
    found = re.search(r"-d '(\{.*?\})'", text, re.DOTALL)
    assert found, "README quick start lost its curl example"
    spec = {**json.loads(found.group(1)), "output_prefix": "demo/out/slurm", "resources": {"pool": "local"}}
    with stack.service.client() as client:
        job_id = _submit(client, spec)
        job = _wait(client, job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), stack)
    assert job["state"] == "succeeded", job
    assert job["slurm_state"] == "COMPLETED"
    assert job["result"]["summary"]["samples_written"] > 0


def test_train_job_spans_two_slurm_nodes(stack: Stack) -> None:
    """One torchrun per node (srun, --ntasks-per-node=1) meeting at the first node's c10d rendezvous."""
    nodes = subprocess.run(["sinfo", "-h", "-p", "two", "-o", "%D"], capture_output=True, text=True, check=False)
    if nodes.stdout.strip() != "2":
        pytest.fail(f"partition two of scripts/slurm-setup.sh is missing (sinfo: {nodes.stdout or nodes.stderr})")
    spec = tiny_spec("tiny/data", resources={"pool": "two", "nnodes": 2, "nproc_per_node": 1}, train_iters=4)
    with stack.service.client() as client:
        job_id = _submit(client, spec)
        job = _wait(client, job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), stack)
        assert job["state"] == "succeeded", job
        points = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": "lm_loss"}).json()["data"]
    assert sorted({p["step"] for p in points if p["rank"] is None}) == [1, 2, 3, 4]
    assert job["result"]["summary"]["world_size"] == 2
    assert job["host"] == f"{_host()}-n[1-2]"  # Slurm's node list of the allocation
    logs = sorted(p.name for p in (Path(job["run_dir"]) / "logs").glob("launcher-node*.log"))
    assert logs == ["launcher-node0.log", "launcher-node1.log"]


def _host() -> str:
    return subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()


def test_seed_chain_pipeline_runs_every_step_in_slurm(stack: Stack, qwen_tokenizer_dir: Path) -> None:
    """preprocess -> convert hf->mg -> train -> convert mg->hf -> eval, each step a Slurm job of the pool."""
    team_area(stack.service.var, "pipe", qwen_tokenizer_dir, train=32, test=8, write_hf=real_vocab_qwen3)
    train = {
        "kind": "train",
        "tokenizer_name_or_path": "pipe/tok",
        "finetune": True,
        "split": "100,0,0",
        "seq_length": 128,
        "micro_batch_size": 4,
        "global_batch_size": 4,
        "train_iters": 3,
        "lr": 1e-3,
        "log_interval": 1,
        **REAL_VOCAB_FLAGS,
    }
    steps = seed_chain_steps("pipe", train, eval_batch_size=8, model_flags=REAL_VOCAB_FLAGS)
    for step in steps:
        step["spec"]["resources"] = {"pool": "local"}
    with stack.service.client() as client:
        pipeline_id = _submit(client, {"kind": "pipeline", "name": "slurm-chain", "steps": steps})
        job = _wait(client, pipeline_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), stack, 600)
        children = {s["name"]: client.get(f"/v1/jobs/{s['job_id']}").json() for s in job["steps"] if s["job_id"]}
        assert job["state"] == "succeeded", (job["error"], job["steps"], [c["error"] for c in children.values()])
    assert list(children) == ["prep", "hf2mg", "train", "mg2hf", "eval"]
    for child in children.values():
        assert child["slurm_job_id"] and child["slurm_state"] == "COMPLETED", child
        assert _squeue(child["slurm_job_id"])[0] == f"llmjobs-{child['id']}"
    assert children["eval"]["result"]["summary"]["total"] == 8


def test_a_job_without_a_pool_stays_on_the_pinned_hosts(stack: Stack) -> None:
    """The agent takes only jobs naming a pool: this one runs on ``llmjobs serve``'s own worker."""
    with stack.service.client() as client:
        job_id = _submit(client, tiny_spec("tiny/data", train_iters=2))
        job = _wait(client, job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), stack)
    assert job["state"] == "succeeded", job
    assert job["slurm_job_id"] is None and job["slurm_state"] is None
    listed = subprocess.run(
        ["squeue", "-h", "--states=all", "-n", f"llmjobs-{job_id}", "-o", "%i"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert listed.stdout.strip() == ""


def test_serve_job_on_a_pool_answers_through_the_api(stack: Stack, qwen_tokenizer_dir: Path) -> None:
    """A deployment in Slurm: its engine reports ready with its URL (the run directory's events), the API routes an
    OpenAI request to it, and a cancel ends it in Slurm."""
    area = stack.service.var / TEAM_AREA / "serve"
    shutil.copytree(qwen_tokenizer_dir, area / "tok")
    real_vocab_qwen3(area / "hf")
    body = {
        "kind": "serve",
        "load": "serve/hf",
        "tokenizer_name_or_path": "serve/tok",
        "served_model_name": "slurm-chat",
        "max_num_seqs": 2,
        "max_model_len": 128,
        "resources": {"pool": "local"},
    }
    with stack.service.client() as client:
        job_id = _submit(client, body)
        deadline = time.monotonic() + 240
        while [m["id"] for m in client.get("/v1/models").json()["data"]] != ["slurm-chat"]:
            job = client.get(f"/v1/jobs/{job_id}").json()
            assert job["state"] in ("queued", "starting", "running"), job
            assert time.monotonic() < deadline, f"never ready:\n{stack.agent_log.read_text()[-3000:]}"
            time.sleep(0.5)
        answer = client.post(
            "/v1/chat/completions",
            json={"model": "slurm-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        job = _wait(client, job_id, lambda j: j["state"] == "cancelled", stack, timeout=90)
    assert job["slurm_state"] == "CANCELLED"
