"""The seed's chain as one pipeline job through the service started as `make run` starts it (`llmjobs serve`: API +
one worker): preprocess -> convert hf->mg -> train -> convert mg->hf -> eval on a tiny random HF Qwen3 with the real
151936 vocabulary and tokenizer; each step a child job with its own logs; a signed webhook for the pipeline's end."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from convert_tiny import REAL_VOCAB_FLAGS, real_vocab_qwen3
from service_support import seed_chain_steps, serve_for_pipelines, team_area

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    yield from serve_for_pipelines(
        tmp_path_factory,
        "pipeline-var",
        LLMJOBS_WORKER_NAME="pipeline-host",
        LLMJOBS_WEBHOOK_POLL_S="0.3",
        LLMJOBS_WEBHOOK_ALLOWED_HOSTS="127.0.0.1",
    )


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    seen: list[tuple[dict[str, str], bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            seen.append(
                ({k.lower(): v for k, v in self.headers.items()}, self.rfile.read(int(self.headers["content-length"])))
            )
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", seen
    server.shutdown()
    server.server_close()


# The seed's GPT_ARGS for the tiny model, spelled out as the seed's scripts do: the engine checks every model flag a
# spec sets against the checkpoint's config.json (flags left unset come from it).
MODEL_FLAGS = REAL_VOCAB_FLAGS


def pipeline_body() -> dict[str, Any]:
    return {
        "kind": "pipeline",
        "name": "seed-chain",
        "metadata": {"seed": "004"},
        "steps": seed_chain_steps(
            "pipe",
            {
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
                **MODEL_FLAGS,
            },
            eval_batch_size=8,
            model_flags=MODEL_FLAGS,
        ),
    }


def test_five_step_pipeline_end_to_end(
    service: tuple[str, str, Path], qwen_tokenizer_dir: Path, receiver: tuple[str, list[tuple[dict[str, str], bytes]]]
) -> None:
    url, token, var = service
    team_area(var, "pipe", qwen_tokenizer_dir, train=32, test=8, write_hf=real_vocab_qwen3)
    hook_url, seen = receiver
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        hook = client.post("/v1/webhooks", json={"url": hook_url, "events": ["job.succeeded", "job.failed"]}).json()
        created = client.post("/v1/jobs", json=pipeline_body())
        assert created.status_code == 201, created.text
        pipeline_id = created.json()["id"]
        deadline = time.monotonic() + 240
        while (job := client.get(f"/v1/jobs/{pipeline_id}").json())["state"] not in (
            "succeeded",
            "failed",
            "cancelled",
        ):
            assert time.monotonic() < deadline, (job, (var / "serve.log").read_text()[-3000:])
            time.sleep(1)
        steps = job["steps"]
        assert job["state"] == "succeeded", (
            job,
            [client.get(f"/v1/jobs/{s['job_id']}").json()["error"] for s in steps if s["job_id"]],
        )
        assert [s["name"] for s in steps] == ["prep", "hf2mg", "train", "mg2hf", "eval"]
        children = {s["name"]: client.get(f"/v1/jobs/{s['job_id']}").json() for s in steps}
        assert all(c["state"] == "succeeded" and c["parent_id"] == pipeline_id for c in children.values())
        # references were replaced by the earlier steps' outputs
        assert children["train"]["spec"]["load"] == children["hf2mg"]["result"]["outputs"]["checkpoint"]
        assert children["eval"]["spec"]["load"] == children["mg2hf"]["result"]["outputs"]["checkpoint"]
        assert children["train"]["result"]["summary"]["iterations"] == 3
        assert (Path(children["mg2hf"]["result"]["outputs"]["checkpoint"]) / "config.json").is_file()
        assert children["eval"]["result"]["summary"]["total"] == 8
        assert job["result"]["outputs"]["eval.predictions"] == children["eval"]["result"]["outputs"]["predictions"]
        # each step has its own metrics and logs
        losses = client.get(f"/v1/jobs/{children['train']['id']}/metrics", params={"names": "lm_loss"}).json()["data"]
        assert len(losses) >= 3
        logs = client.get(f"/v1/jobs/{children['prep']['id']}/logs", params={"limit": 1000}).json()["data"]
        assert logs
        # Deliveries are POSTed concurrently (no order between them, as with any webhook sender): wait for all six.
        succeeded = lambda: sum(json.loads(b)["type"] == "job.succeeded" for _, b in seen)  # noqa: E731
        deadline = time.monotonic() + 20
        while succeeded() < 6 and time.monotonic() < deadline:
            time.sleep(0.3)
    ends = [(h, b) for h, b in seen if json.loads(b)["data"]["id"] == pipeline_id]
    assert len(ends) == 1 and json.loads(ends[0][1])["type"] == "job.succeeded"
    assert succeeded() == 6  # 5 steps + the pipeline, each once
    headers, body = ends[0]
    key = base64.b64decode(hook["secret"].removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    assert (
        headers["webhook-signature"]
        == "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    )
