"""Submission refuses (422 naming optimizer_offload_fraction) a job whose offloaded optimizer state does not fit the
RAM its hosts registered (issue 42): ``worker.hosts.register_host`` stores the host's RAM next to its device memory,
``core.scheduler.check_memory_fits`` hands both to the planner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from core.db import session_scope
from core.models import Host
from core.settings import Settings
from core_support import auth, isolated_settings, team_dir
from engine.contract.plan.memory import GIB
from engine.contract.plan.planner import HOST_MEMORY_KEY
from worker.hosts import register_host

QWEN3_32B = {  # MindSpeed-LLM's Qwen3-32B flags: admission plans from them
    "num_layers": 64,
    "hidden_size": 5120,
    "ffn_hidden_size": 25600,
    "num_attention_heads": 64,
    "group_query_attention": True,
    "num_query_groups": 8,
    "kv_channels": 128,
    "padded_vocab_size": 151936,
}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = isolated_settings(tmp_path)
    for suffix in (".bin", ".idx"):  # the data_path prefix "d" exists (admission checks inputs before the planner)
        (team_dir(settings, "alpha") / f"d{suffix}").write_bytes(b"")
    return settings


def npu_host(settings: Settings, host_gib: int | None) -> None:
    register_host(
        settings,
        name="npu1",
        device_type="npu",
        devices=8,
        queues=["host.npu1"],
        device_memory=64 * GIB,
        host_memory=None if host_gib is None else host_gib * GIB,
    )


def offloaded_32b(**extra: Any) -> dict[str, Any]:
    """Qwen3-32B full SFT, TP4 PP2 on one node, the optimizer state (fp32 master and moments: 12 B per parameter,
    about 366 GiB for the node) on the host."""
    return {
        "kind": "train",
        "data_path": ["d"],
        "train_iters": 10,
        "lr": 1e-6,
        "bf16": True,
        "seq_length": 4096,
        "micro_batch_size": 1,
        "global_batch_size": 64,
        "tensor_model_parallel_size": 4,
        "pipeline_model_parallel_size": 2,
        "sequence_parallel": True,
        "use_distributed_optimizer": True,
        "use_precision_aware_optimizer": True,
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": 1.0,
        **QWEN3_32B,
        "resources": {"device_type": "npu", "nproc_per_node": 8},
        **extra,
    }


def test_register_host_stores_its_ram(settings: Settings) -> None:
    npu_host(settings, 256)
    with session_scope(settings.database_url) as session:
        host = session.get(Host, "npu1")
        assert host is not None and host.info[HOST_MEMORY_KEY] == 256 * GIB


def test_offloaded_state_over_the_hosts_ram_is_refused(client: TestClient, token: str, settings: Settings) -> None:
    npu_host(settings, 256)
    response = client.post("/v1/jobs", json=offloaded_32b(), headers=auth(token))
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["code"] == "does_not_fit" and body["field"] == "optimizer_offload_fraction"
    assert "host memory" in body["message"] and "256.00 GiB" in body["message"]
    # half of the state on the host fits 256 GiB; the device holds the other half (with full recompute it fits)
    smaller = offloaded_32b(optimizer_offload_fraction=0.5, recompute_granularity="full")
    half = client.post("/v1/jobs", json=smaller, headers=auth(token))
    assert half.status_code == 201, half.text


def test_a_host_with_room_admits_it(client: TestClient, token: str, settings: Settings) -> None:
    npu_host(settings, 512)
    assert client.post("/v1/jobs", json=offloaded_32b(), headers=auth(token)).status_code == 201


def test_hosts_that_report_no_ram_are_not_checked_on_it(client: TestClient, token: str, settings: Settings) -> None:
    npu_host(settings, None)
    assert client.post("/v1/jobs", json=offloaded_32b(), headers=auth(token)).status_code == 201
