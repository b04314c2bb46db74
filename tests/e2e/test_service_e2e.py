"""The service started the way `make run` starts it (`llmjobs serve` on a free port with its own var dir):
the README's demo job end to end over HTTP and SSE, idempotent replay, and a cancel that leaves no process behind."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from httpx_sse import connect_sse

from cli.demo import intent_samples, write_jsonl
from core.settings import REPO_ROOT
from service_support import Service, serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with serve(
        tmp_path_factory.mktemp("service-var"),
        LLMJOBS_CANCEL_GRACE_S="3",
        LLMJOBS_HEARTBEAT_INTERVAL_S="1",
        # a device sample each second: the dashboard test reads one while a short train job holds the device
        LLMJOBS_TELEMETRY_INTERVAL_S="1",
        LLMJOBS_WORKER_NAME="e2e-host",
    ) as svc:
        yield svc


def readme_example() -> tuple[dict[str, Any], str]:
    """The job body and Idempotency-Key of the README's curl example (so the README stays true)."""
    text = (REPO_ROOT / "README.md").read_text()
    body = re.search(r"-d '(\{.*?\})'", text, re.DOTALL)
    key = re.search(r"Idempotency-Key: ([\w-]+)", text)
    assert body and key, "README quick start lost its curl example"
    return json.loads(body.group(1)), key.group(1)


def follow(
    service: Service, job_id: str, last_event_id: str | None = None, timeout: float = 240
) -> list[dict[str, Any]]:
    headers = {
        "Authorization": f"Bearer {service.token}",
        **({"Last-Event-ID": last_event_id} if last_event_id else {}),
    }
    messages: list[dict[str, Any]] = []
    with (
        httpx.Client(timeout=httpx.Timeout(10, read=timeout)) as client,
        connect_sse(client, "GET", f"{service.url}/v1/jobs/{job_id}/stream", headers=headers) as source,
    ):
        assert source.response.status_code == 200
        for sse in source.iter_sse():
            if sse.data:
                messages.append({"event": sse.event, "id": sse.id, "data": json.loads(sse.data)})
    return messages


def test_readme_demo_job_end_to_end(service: Service) -> None:
    body, key = readme_example()
    with service.client() as client:
        created = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]

        messages = follow(service, job_id)
        assert messages[-1]["event"] == "end"
        states = [m["data"]["data"]["state"] for m in messages if m["event"] == "state"]
        assert states == ["queued", "starting", "running", "succeeded"], service.log.read_text()[-2000:]
        event_types = [m["data"]["type"] for m in messages if m["event"] == "event"]
        assert event_types[0] == "started" and "progress" in event_types and event_types[-1] == "finished"
        sse_logs = [m["data"]["text"] for m in messages if m["event"] == "log"]
        assert any("preprocess summary" in line for line in sse_logs)

        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["state"] == "succeeded" and job["error"] is None and job["finished_at"]
        assert job["result"]["summary"]["samples_written"] == 200
        artifacts = {a["name"]: a for a in client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]}
        files = artifacts["data_path"]["files"]
        assert {Path(f).suffix for f in files} == {".bin", ".idx"} and all(Path(f).stat().st_size for f in files)
        assert artifacts["data_path"]["size_bytes"] == sum(Path(f).stat().st_size for f in files)

        events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
        assert [e["type"] for e in events if e["type"] != "state"] == event_types
        streams = {m["data"]["stream"] for m in messages if m["event"] == "log"}
        api_logs = sum(
            len(client.get(f"/v1/jobs/{job_id}/logs", params={"stream": s, "limit": 5000}).json()["data"])
            for s in streams
        )
        assert api_logs == len(sse_logs)

        # Resume in the middle: exactly the messages after that id come again, none twice (the id is a cursor over
        # the event, metric and log feeds, so the order across feeds may differ from the live stream's batches).
        middle = len(messages) // 2
        resumed = follow(service, job_id, last_event_id=messages[middle]["id"])
        canon = sorted(json.dumps(m["data"], sort_keys=True) for m in resumed)
        assert canon == sorted(json.dumps(m["data"], sort_keys=True) for m in messages[middle + 1 :])
        assert len(set(canon)) == len(canon)

        # Idempotent replay: same key and body -> same job; same key, other body -> 409.
        replay = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": key})
        assert replay.status_code == 201 and replay.json()["id"] == job_id
        assert replay.headers["Idempotent-Replayed"] == "true"
        conflict = client.post("/v1/jobs", json={**body, "name": "another"}, headers={"Idempotency-Key": key})
        assert conflict.status_code == 409 and conflict.json()["field"] == "Idempotency-Key"


def _job_processes(job_id: str) -> list[psutil.Process]:
    """Every live process started for this job (the launcher puts LLMJOBS_JOB_ID in their environment)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("LLMJOBS_JOB_ID") == job_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_cancel_leaves_no_process_of_the_job(service: Service) -> None:
    big = service.var / "data" / "teams" / "default" / "demo" / "big_train.jsonl"
    write_jsonl(big, intent_samples(300_000))  # minutes of tokenizing: it is still at work when cancelled
    body, _ = readme_example()
    body = {
        **body,
        "input": "demo/big_train.jsonl",
        "output_prefix": "demo/out/big",
        "workers": 2,
        "log_interval": 2000,
    }
    with service.client() as client:
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # cancel once the engine and its tokenizer workers are busy
            events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
            if any(e["type"] == "progress" for e in events):
                break
            assert client.get(f"/v1/jobs/{job_id}").json()["state"] in ("queued", "starting", "running")
            time.sleep(0.5)
        else:
            raise AssertionError(f"no progress event:\n{service.log.read_text()[-3000:]}")
        before = _job_processes(job_id)
        assert len(before) >= 3, f"expected the engine and 2 tokenizer workers, found {before}"

        cancelled = client.post(f"/v1/jobs/{job_id}/cancel")
        assert cancelled.status_code == 202 and cancelled.json()["state"] == "cancelling"
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{job_id}").json()["state"] != "cancelled":
            assert time.monotonic() < deadline, "cancel did not finish"
            time.sleep(0.3)
        assert _job_processes(job_id) == []
        assert not [p.pid for p in before if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        states = [
            e["data"]["state"]
            for e in client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
            if e["type"] == "state"
        ]
        assert states[-2:] == ["cancelling", "cancelled"]
        assert client.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"  # idempotent


def test_bad_input_fails_once_with_message_and_log_tail(service: Service) -> None:
    broken = service.var / "data" / "teams" / "default" / "demo" / "broken.jsonl"
    write_jsonl(broken, intent_samples(5))
    with open(broken, "a") as f:
        f.write("{this is not json\n")
    body, _ = readme_example()
    with service.client() as client:
        job_id = client.post("/v1/jobs", json={**body, "input": "demo/broken.jsonl", "max_restarts": 3}).json()["id"]
        assert follow(service, job_id)[-1]["event"] == "end"
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "failed" and job["attempt_count"] == 1  # bad input is never retried
    assert job["error"]["code"] == "bad_input"
    assert "broken.jsonl" in job["error"]["message"] and "line 6" in job["error"]["message"]
    assert "broken.jsonl" in job["error"]["log_tail"]


def _cli(service: Service, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMJOBS_")}
    env.update(LLMJOBS_URL=service.url, LLMJOBS_TOKEN=service.token, LLMJOBS_VAR_DIR=str(service.var))
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_client_commands(service: Service, tmp_path: Path) -> None:
    body, _ = readme_example()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({**body, "output_prefix": "demo/out/cli"}))
    submitted = _cli(service, "submit", str(spec), "--follow")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[0]
    assert f"{job_id} succeeded" in submitted.stderr
    assert job_id in _cli(service, "list", "--state", "succeeded").stdout
    assert json.loads(_cli(service, "status", job_id, "--json").stdout)["state"] == "succeeded"
    assert "succeeded" in _cli(service, "status", job_id).stdout
    assert "preprocess summary" in _cli(service, "logs", job_id).stdout
    assert _cli(service, "metrics", job_id).returncode == 0
    cancel = _cli(service, "cancel", job_id)
    assert cancel.returncode == 1 and "job_finished" in cancel.stderr
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(3_000_000))  # over max_body_bytes: uploads stream past the body limit
    uploaded = _cli(service, "upload", str(blob), "e2e/blob.bin")
    assert uploaded.returncode == 0, uploaded.stderr
    assert hashlib.sha256(blob.read_bytes()).hexdigest() in uploaded.stdout
    assert Path(uploaded.stdout.split()[0]).read_bytes() == blob.read_bytes()
    token = _cli(service, "token", "create", "--team", "cli-team").stdout.strip()
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {token}"}) as other:
        assert other.get(f"/v1/jobs/{job_id}").status_code == 404  # another team's job
        listed = [line.split("\t") for line in _cli(service, "token", "list", "--team", "cli-team").stdout.splitlines()]
        assert [(row[1], row[2], row[-1]) for row in listed] == [(token[:12], "cli-team", "active")]
        revoked = _cli(service, "token", "revoke", token[:12])
        assert revoked.returncode == 0, revoked.stderr
        assert other.get(f"/v1/jobs/{job_id}").status_code == 401
        assert _cli(service, "token", "list", "--team", "cli-team").stdout.split("\t")[-1].startswith("revoked")
        assert _cli(service, "token", "revoke", token[:12]).returncode == 1  # nothing active by that name


def test_llmjobs_run_in_the_foreground(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", intent_samples(50))
    body, _ = readme_example()
    spec = {
        **body,
        "input": str(data / "train.jsonl"),
        "tokenizer_name_or_path": str(qwen_tokenizer_dir),
        "output_prefix": str(data / "out" / "fg"),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMJOBS_")}
    run = subprocess.run(
        [sys.executable, "-m", "cli.main", "run", str(tmp_path / "spec.json"), "--run-dir", str(tmp_path / "run")],
        env={**env, "LLMJOBS_VAR_DIR": str(tmp_path / "var")},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["kind"] == "preprocess" and result["summary"]["samples_written"] == 50
    assert "[finished] preprocess succeeded" in run.stderr
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "result.json").read_text()) == result
    assert (
        (run_dir / "spec.json").exists()
        and (run_dir / "events.jsonl").exists()
        and (run_dir / "logs" / "rank0.log").exists()
    )
    (tmp_path / "bad.json").write_text(json.dumps({**spec, "workers": 0}))
    bad = subprocess.run(
        [sys.executable, "-m", "cli.main", "run", str(tmp_path / "bad.json")],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "workers:" in bad.stderr
