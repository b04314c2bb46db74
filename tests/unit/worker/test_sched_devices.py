"""Device discovery without the accelerator libraries: torch_npu / torch.cuda are replaced by stand-ins that
report a device count (the only true outside boundary here: this machine has no NPU or GPU)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from worker.devices import discover, host_address


@pytest.fixture
def fake_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = types.ModuleType("torch")
    torch.npu = types.SimpleNamespace(device_count=lambda: 8)  # type: ignore[attr-defined]
    torch.cuda = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 4)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails, as on a GPU host


def test_npu_devices_come_from_torch_npu(fake_npu: None) -> None:
    inv = discover("npu", env={})
    assert (inv.device_type, inv.device_ids, inv.source) == ("npu", list(range(8)), "torch_npu")
    assert discover("auto", env={}).device_type == "npu"


def test_cuda_devices_and_visible_devices_restrict_the_host(fake_cuda: None) -> None:
    assert discover("auto", env={}).device_ids == [0, 1, 2, 3]
    inv = discover("cuda", env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert (inv.device_ids, inv.source) == ([2, 3], "visible-devices")  # physical ids, as the launcher exposes them
    assert discover("cuda", configured=1, env={"CUDA_VISIBLE_DEVICES": "2,3"}).device_ids == [2]


def test_cpu_is_configured_slots_and_missing_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    inv = discover("cpu", configured=4, env={})
    assert (inv.device_type, inv.device_ids, inv.source) == ("cpu", [0, 1, 2, 3], "configured")
    assert discover("cpu", env={}).device_ids == [0]
    with pytest.raises(RuntimeError, match="torch_npu finds no device"):
        discover("npu", env={})
    with pytest.raises(ValueError, match="ASCEND_RT_VISIBLE_DEVICES"):
        discover("npu", env={"ASCEND_RT_VISIBLE_DEVICES": "a,b"})


def test_host_address() -> None:
    assert host_address("10.0.0.7") == "10.0.0.7"
    assert host_address().count(".") == 3


def test_node_plan_exposes_exactly_the_leased_devices_and_the_rendezvous(tmp_path: Path) -> None:
    from worker.leases import NODE_ENV
    from worker.node import NodeWork, node_plan

    spec = {
        "kind": "preprocess",
        "input": "a",
        "tokenizer_name_or_path": "t",
        "output_prefix": "o",
        "resources": {"device_type": "npu", "nnodes": 2, "nproc_per_node": 2},
    }
    work = NodeWork(
        node_id=7,
        job_id="j1",
        attempt=3,
        node_rank=1,
        nnodes=2,
        spec=spec,
        run_dir=tmp_path,
        devices=[4, 6],
        master_addr="10.0.0.1",
        master_port=29611,
    )
    plan = node_plan(work)
    assert plan.env["ASCEND_RT_VISIBLE_DEVICES"] == "4,6"
    assert plan.env[NODE_ENV] == "j1:3:1"
    argv = " ".join(plan.argv)
    assert (
        "--nnodes 2 --node-rank 1" in argv and "--rdzv-endpoint 10.0.0.1:29611" in argv and "--nproc-per-node 2" in argv
    )
    cpu = node_plan(NodeWork(7, "j1", 1, 0, 1, {**spec, "resources": {"nproc_per_node": 2}}, tmp_path, [2, 3], "h", 1))
    assert (
        cpu.env["LLMJOBS_DEVICES"] == "2,3" and "--standalone" in cpu.argv
    )  # CPU: the leased slots, no device variable
