"""A broker outage: `llmjobs serve` with its Celery broker on a private Redis that is stopped while a job runs (losing
every message it held: no persistence) and started again. The running job goes on (its worker needs the database,
not the broker). The API stays up: a submission during the outage is committed and acknowledged (201: the job row,
not the message, is the record), GET and /readyz answer 200 (the database is fine; only dispatch waits). Once Redis
is back the worker reconnects, the Dispatcher and the reconciler re-send what was lost, and every acknowledged job
succeeds, each on its first attempt."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from outage_support import private_redis
from service_support import serve

pytestmark = pytest.mark.slow


def preprocess(n: int) -> dict[str, Any]:
    """The README's demo preprocess job (a few seconds), into its own output prefix."""
    return {
        "kind": "preprocess",
        "name": f"broker-{n}",
        "input": "demo/intent_train.jsonl",
        "tokenizer_name_or_path": "demo/qwen3-tokenizer",
        "output_prefix": f"out/b{n}",
        "tokenizer_type": "PretrainedFromHF",
        "handler_name": "SharegptStyleInstructionHandler",
        "prompt_type": "qwen3",
        "map_keys": {
            "messages": "messages",
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
                "system_tag": "system",
            },
        },
    }


def submit(client: httpx.Client, n: int) -> str:
    answer = client.post("/v1/jobs", json=preprocess(n))
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def wait(client: httpx.Client, path: str, good: Callable[[Any], bool], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not good(answer := client.get(path).json()) and time.monotonic() < deadline:
        time.sleep(0.3)
    return answer


def test_jobs_submitted_around_a_broker_restart_all_run_once(tmp_path: Path) -> None:
    with (
        private_redis() as redis,
        serve(
            tmp_path,
            LLMJOBS_BROKER_URL=redis.url,
            LLMJOBS_REDIS_URL=redis.url,
            LLMJOBS_WORKER_NAME="broker-host",
            LLMJOBS_WORKER_DEVICES="2",
            LLMJOBS_HEARTBEAT_INTERVAL_S="1",
            LLMJOBS_RECONCILE_INTERVAL_S="1",
            LLMJOBS_REDISPATCH_AFTER_S="3",
        ) as service,
        service.client() as client,
    ):
        hosts = wait(client, "/v1/hosts", lambda page: [h["health"] for h in page["data"]] == ["up"], 120)
        assert [h["name"] for h in hosts["data"]] == ["broker-host"], hosts  # the worker is up on the broker
        started = time.monotonic()
        acknowledged = [submit(client, 0)]
        first = wait(
            client,
            f"/v1/jobs/{acknowledged[0]}",
            lambda job: job["state"] != "queued" and job["state"] != "starting",
            120,
        )
        assert first["state"] == "running", first  # its worker took the message from Redis
        redis.stop()
        acknowledged.append(submit(client, 1))  # committed; its message waits for the broker
        # queued, or granted a device (a database write) with its run_node message waiting for the broker
        assert client.get(f"/v1/jobs/{acknowledged[-1]}").json()["state"] in ("queued", "starting")
        assert client.get("/readyz").status_code == 200 and client.get("/healthz").status_code == 200
        time.sleep(2)
        redis.start()
        ended = ("succeeded", "failed", "cancelled")  # a generous bound below, for a loaded machine
        jobs = [wait(client, f"/v1/jobs/{job_id}", lambda job: job["state"] in ended, 150) for job_id in acknowledged]
        states = [(job["name"], job["state"], job["attempt_count"]) for job in jobs]
        assert states == [(f"broker-{n}", "succeeded", 1) for n in range(2)], (
            f"{states}\n{service.log.read_text()[-3000:]}"
        )
        assert "Unrecoverable error" not in service.log.read_text()  # the worker survived the lost connection
        listed = client.get("/v1/jobs", params={"limit": 100}).json()["data"]
        assert sorted(job["id"] for job in listed) == sorted(acknowledged)  # none lost, none made twice
        print(f"broker outage: both jobs succeeded {time.monotonic() - started:.1f} s after the first submission")
