"""A tiny Qwen3-MoE through the service as a user runs it (`llmjobs serve`, one worker with two devices): one
pipeline preprocesses the data, converts the transformers-written checkpoint to Megatron, trains it with expert
parallelism 2, converts back and evaluates, and trains LoRA adapters on attention and on every expert with EP2. The router's figures
reach the metrics API next to the loss."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from convert_tiny import REAL_VOCAB_FLAGS, real_vocab_qwen3_moe
from service_support import seed_chain_steps, serve_for_pipelines, team_area

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The seed's GPT_ARGS for the tiny model plus MindSpeed's Qwen3-MoE flags, spelled out as a user's script does.
MODEL_FLAGS: dict[str, Any] = {
    **REAL_VOCAB_FLAGS,
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
}
TRAIN: dict[str, Any] = {
    "kind": "train",
    "tokenizer_name_or_path": "moe/tok",
    "finetune": True,
    "split": "100,0,0",
    "seq_length": 64,
    "micro_batch_size": 2,
    "global_batch_size": 4,
    "train_iters": 3,
    "lr": 1e-3,
    "log_interval": 1,
    "expert_model_parallel_size": 2,
    "resources": {"nproc_per_node": 2},
    "moe_aux_loss_coeff": 0.01,
    **MODEL_FLAGS,
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    yield from serve_for_pipelines(
        tmp_path_factory, "moe-var", LLMJOBS_WORKER_NAME="moe-host", LLMJOBS_WORKER_DEVICES="2"
    )


def _finish(client: httpx.Client, job_id: str, var: Path, timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (job := client.get(f"/v1/jobs/{job_id}").json())["state"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, (job, (var / "serve.log").read_text()[-3000:])
        time.sleep(1)
    return job


def _pipeline() -> dict[str, Any]:
    return {
        "kind": "pipeline",
        "name": "moe-chain",
        "steps": [
            *seed_chain_steps("moe", TRAIN, eval_batch_size=4, model_flags=MODEL_FLAGS),
            {
                "name": "lora",
                "spec": {
                    **TRAIN,
                    "data_path": "${steps.prep.outputs.data_path}",
                    "load": "moe/hf",
                    "save": "moe/lora",
                    "lora_r": 4,
                },
            },
        ],
    }


def _router_series(client: httpx.Client, job_id: str) -> dict[str, list[Any]]:
    names = "lm_loss,load_balancing_loss,expert_load_imbalance_max"
    rows = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": names}).json()["data"]
    series: dict[str, list[Any]] = {}
    for row in rows:
        series.setdefault(row["name"], []).append(row)
    return series


def test_moe_trains_with_expert_parallelism_converts_and_evaluates(
    service: tuple[str, str, Path], qwen_tokenizer_dir: Path
) -> None:
    url, token, var = service
    team_area(var, "moe", qwen_tokenizer_dir, train=16, test=4, write_hf=real_vocab_qwen3_moe)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        created = client.post("/v1/jobs", json=_pipeline())
        assert created.status_code == 201, created.text
        job = _finish(client, created.json()["id"], var)
        children = {s["name"]: client.get(f"/v1/jobs/{s['job_id']}").json() for s in job["steps"]}
        assert job["state"] == "succeeded", {n: c["error"] for n, c in children.items()}
        train = children["train"]
        assert train["result"]["summary"]["iterations"] == 3
        assert (Path(children["mg2hf"]["result"]["outputs"]["checkpoint"]) / "config.json").is_file()
        assert children["eval"]["result"]["summary"]["total"] == 4
        for job_id in (train["id"], children["lora"]["id"]):
            series = _router_series(client, job_id)
            assert {len(v) for v in series.values()} == {3}, series  # one point per iteration, each figure
            assert all(p["value"] >= 1.0 for p in series["expert_load_imbalance_max"])  # max/mean >= 1
            assert all(p["value"] > 0 for p in series["load_balancing_loss"])
