"""Device layer on a machine without torch_npu, CUDA or flash-attn: selection, memory, peak table, FLOPs."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import types

import pytest
import torch.distributed as dist

from engine.contract.model_config import preset
from engine.model import kernels
from engine.parallel import device as dev


def test_npu_needs_torch_npu_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # make the import fail even where it is installed
    with pytest.raises(RuntimeError, match="torch_npu is not installed"):
        dev.init_distributed("npu")
    assert kernels.attention_kernel("npu") == "sdpa"


def test_unknown_device_type_is_refused() -> None:
    with pytest.raises(ValueError, match="device_type"):
        dev.init_distributed("tpu")  # type: ignore[arg-type]


def test_attention_kernel_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kernels.attention_kernel("cpu") == "sdpa"
    assert kernels.attention_kernel("cuda") == "sdpa"  # no CUDA device here
    monkeypatch.setattr(kernels, "_cuda_has_flash", lambda: True)  # as on an A100/H100
    assert kernels.attention_kernel("cuda") == "torch_varlen"  # this torch ships torch.nn.attention.varlen
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "flash_attn" else None)
    assert kernels.attention_kernel("cuda") == "flash_varlen"  # an older torch with the flash-attn package
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None)
    assert kernels.attention_kernel("cuda") == "sdpa"
    # an NPU tensor means torch_npu is loaded; the kernel is used only if this torch_npu has it
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace())
    assert kernels.attention_kernel("npu") == "sdpa"
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=object()))
    assert kernels.attention_kernel("npu") == "npu_fusion"


def test_cpu_device_and_memory_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    had_group = dist.is_initialized()
    d = dev.init_distributed("cpu")
    assert d.backend == "gloo" and str(d.torch_device) == "cpu" and dist.is_initialized() == had_group
    stats = d.memory_stats()
    assert set(stats) == {"mem_allocated_mb", "mem_max_allocated_mb", "mem_reserved_mb"}
    assert 10 < stats["mem_allocated_mb"] <= stats["mem_max_allocated_mb"]
    assert d.peak_tflops() is None  # no CPU entry: MFU is reported as unknown


def test_init_distributed_single_rank_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    if dist.is_initialized():
        pytest.skip("another test left a process group in this process")
    with socket.socket() as s:  # a free port: other tests may run process groups at the same time
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        d = dev.init_distributed("cpu")
        assert dist.is_initialized() and dist.get_backend() == "gloo" and d.type == "cpu"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_hccl_timeouts_from_spec_unless_env_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT", raising=False)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "99")
    dev._set_hccl_timeouts(1200, 7200)
    assert os.environ["HCCL_CONNECT_TIMEOUT"] == "1200" and os.environ["HCCL_EXEC_TIMEOUT"] == "99"


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Ascend910B2", 354.0),
        ("Ascend910B3", 295.0),
        ("Ascend910_9392", 390.0),
        ("Ascend910B4", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("cpu", None),
    ],
)
def test_peak_table_never_guesses(name: str, tflops: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dev.PEAK_ENV, raising=False)
    assert dev.peak_bf16_tflops(name) == tflops


def test_measured_peak_overrides_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dev.PEAK_ENV, "300")
    assert dev.peak_bf16_tflops("Ascend910B4") == 300.0


def test_flops_per_token_matches_published_arithmetic() -> None:
    # docs/anchors-engine.md §5: Qwen3-4B 6N = 24.13 GF; S=4096 -> 31.38 GF; S=2048 -> 27.76; Qwen3-8B @4096 -> 52.7
    cfg4 = preset("qwen3-4b")
    assert dev.flops_per_token(cfg4, 4096) / 1e9 == pytest.approx(31.38, abs=0.01)
    assert dev.flops_per_token(cfg4, 2048) / 1e9 == pytest.approx(27.76, abs=0.01)
    assert dev.flops_per_token(cfg4, 2048, causal=True) / 1e9 == pytest.approx(25.95, abs=0.01)
    assert dev.flops_per_token(preset("qwen3-8b"), 4096) / 1e9 == pytest.approx(52.7, abs=0.05)
    lora = dev.flops_per_token(cfg4, 0, lora=True)
    assert lora == pytest.approx(dev.flops_per_token(cfg4, 0) * 4 / 6)
