"""A tiny Qwen3-MoE through the service as a user runs it (`llmjobs serve`, one worker with two devices): one
pipeline preprocesses the data, converts the transformers-written checkpoint to Megatron, trains it with expert
parallelism 2, converts back and evaluates, and trains LoRA adapters on attention and on every expert with EP2. The router's figures
reach the metrics API next to the loss."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.demo import intent_samples, write_jsonl
from service_support import serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The seed's GPT_ARGS for the tiny model plus MindSpeed's Qwen3-MoE flags, spelled out as a user's script does.
MODEL_FLAGS: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "kv_channels": 16,
    "group_query_attention": True,
    "num_query_groups": 2,
    "padded_vocab_size": 151936,
    "make_vocab_size_divisible_by": 1,
    "norm_epsilon": 1e-6,
    "rotary_base": 1_000_000.0,
    "untie_embeddings_and_output_weights": True,
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
    "swiglu": True,
    "qk_layernorm": True,
    "disable_bias_linear": True,
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
    with serve(
        tmp_path_factory.mktemp("moe-var"),
        LLMJOBS_HEARTBEAT_INTERVAL_S="1",
        LLMJOBS_WORKER_NAME="moe-host",
        LLMJOBS_WORKER_DEVICES="2",
        LLMJOBS_RECONCILE_INTERVAL_S="1",
        OMP_NUM_THREADS="1",
    ) as svc:
        yield svc.url, svc.token, svc.var


def tiny_hf_qwen3_moe(path: Path) -> None:
    """A random Qwen3-MoE with the real vocabulary, hidden 64, 2 layers of 4 experts (top-2), by transformers."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=512,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    Qwen3MoeForCausalLM(config).save_pretrained(path)


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
            {
                "name": "prep",
                "spec": {
                    "kind": "preprocess",
                    "input": "moe/train.jsonl",
                    "tokenizer_name_or_path": "moe/tok",
                    "output_prefix": "moe/data/intent",
                    "handler_name": "SharegptStyleInstructionHandler",
                    "prompt_type": "qwen3",
                },
            },
            {
                "name": "hf2mg",
                "spec": {
                    "kind": "convert",
                    "load_model_type": "hf",
                    "save_model_type": "mg",
                    "load_dir": "moe/hf",
                    "save_dir": "moe/mg",
                },
            },
            {
                "name": "train",
                "spec": {
                    **TRAIN,
                    "data_path": "${steps.prep.outputs.data_path}",
                    "load": "${steps.hf2mg.outputs.checkpoint}",
                    "save": "moe/trained",
                },
            },
            {
                "name": "mg2hf",
                "spec": {
                    "kind": "convert",
                    "load_model_type": "mg",
                    "save_model_type": "hf",
                    "load_dir": "${steps.train.outputs.checkpoint}",
                    "save_dir": "moe/final",
                },
            },
            {
                "name": "eval",
                "spec": {
                    "kind": "eval",
                    "load": "${steps.mg2hf.outputs.checkpoint}",
                    "tokenizer_name_or_path": "moe/tok",
                    "eval_data_path": "moe/test.jsonl",
                    "max_new_tokens": 4,
                    "greedy": True,
                    "eval_batch_size": 4,
                    **MODEL_FLAGS,
                },
            },
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
    area = var / "data" / "teams" / "default" / "moe"  # the serve admin token's team area
    shutil.copytree(qwen_tokenizer_dir, area / "tok")
    write_jsonl(area / "train.jsonl", intent_samples(16, seed=1))
    write_jsonl(area / "test.jsonl", intent_samples(4, seed=2))
    tiny_hf_qwen3_moe(area / "hf")
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
