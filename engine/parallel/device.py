"""Device layer: which accelerator, which collective backend, memory figures, peak FLOPS and the FLOPs formula.

cpu -> gloo, cuda -> nccl, npu -> hccl. ``torch_npu`` is imported only when an NPU is asked for, so this module (and
everything that imports it) loads on machines without it. Which fused attention kernel a device offers is
``engine.model.kernels`` (the model imports it; this package imports the model, never the reverse).

Peak-FLOPS figures and the FLOPs-per-token formula come from ``docs/anchors-engine.md`` §5.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import importlib.util
import os
import re
import resource
from types import ModuleType
from typing import Literal

import psutil
import torch
import torch.distributed as dist

from engine.contract.model_config import ModelConfig

DeviceType = Literal["cpu", "cuda", "npu"]

BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_MB = 1024 * 1024

# Dense BF16 peak TFLOPs per device as the framework sees it (one NPU die = one device), first match wins.
# Sources (docs/anchors-engine.md §5): NVIDIA figures as in torchtitan tools/utils.py get_peak_flops and the
# NVIDIA sheets; Ascend 910B = 354 as in MindSpeed fsdp2/utils/flops/flops_base.py (and 24 cube cores x 16^3 FMA x 2
# x ~1.8 GHz); 910B3 has 20 cube cores -> same calc 295 (derived, not published); 910C (A3) ~780 per chip = 2 dies,
# each die one device "Ascend910_93xx" (TechPowerUp, Apr 2025). SKUs whose figure we do not have map to None: the
# MFU is then reported as unknown instead of guessed (torchtitan's fallback to A100 would mis-state NPU MFU).
PEAK_BF16_TFLOPS: list[tuple[str, float | None]] = [
    (r"H100.*NVL", 835.0),
    (r"H100.*PCIe", 756.0),
    (r"H100", 989.0),
    (r"H200.*NVL", None),  # not in our sources
    (r"H200", 989.0),
    (r"A100", 312.0),
    (r"Ascend910B2", 354.0),
    (r"Ascend910B3", 295.0),
    (r"Ascend910B1|Ascend910B4", None),  # core counts / clocks not in our sources: measure, then set the env var
    (r"Ascend910_93", 390.0),
]
PEAK_ENV = "LLMJOBS_PEAK_TFLOPS"  # a measured figure for this machine overrides the table


def peak_bf16_tflops(device_name: str) -> float | None:
    """Dense BF16 peak of one device named ``device_name``, or None when unknown (never a guess)."""
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV])
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = False, lora: bool = False) -> float:
    """Training FLOPs per token (forward + backward, recompute not counted), torchtitan's convention.

    6·N + 12·L·heads·head_dim·S, with N = parameters without the input embedding (MoE: the active ones, top-k
    experts and the router) (a tied embedding is kept, because
    the output matmul uses it) — torchtitan ``get_dense_model_nparams_and_flops``. ``causal=True`` halves the
    attention term as Megatron main does. ``lora=True`` counts 4·N: no weight gradients for frozen matmuls
    (docs/anchors-engine.md §2, LoRA 4B). For packed batches pass the mean of L_i² / L_i over samples as ``seq_len``.
    """
    n = cfg.num_params(include_embedding=True, active=True)  # MoE: the top-k experts a token runs through
    if not cfg.tie_word_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size
    attn = 12 * cfg.num_layers * cfg.num_attention_heads * cfg.kv_channels * seq_len
    return (4 if lora else 6) * n + attn * (0.5 if causal else 1.0)


def import_torch_npu() -> ModuleType:
    """Import ``torch_npu`` (registers ``torch.npu``); a clear error when it is not installed."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise RuntimeError(
            "device_type npu: torch_npu is not installed (pip install llmjobs[npu] on an Ascend host with CANN)"
        ) from exc


def _accelerator(device_type: str) -> ModuleType | None:
    if device_type == "cuda":
        return torch.cuda
    if device_type == "npu":
        import_torch_npu()
        return torch.npu  # type: ignore[attr-defined]
    return None


@dataclasses.dataclass(frozen=True)
class Device:
    """One local device of a rank."""

    type: DeviceType
    index: int = 0

    @property
    def backend(self) -> str:
        return BACKENDS[self.type]

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.type == "cpu" else torch.device(self.type, self.index)

    def name(self) -> str:
        acc = _accelerator(self.type)
        return "cpu" if acc is None else acc.get_device_name(self.index)

    def peak_tflops(self) -> float | None:
        """Dense BF16 peak, None when unknown; CPUs have no entry."""
        return None if self.type == "cpu" else peak_bf16_tflops(self.name())

    def synchronize(self) -> None:
        acc = _accelerator(self.type)
        if acc is not None:
            acc.synchronize(self.index)

    def empty_cache(self) -> None:
        """Give cached, unused blocks back to the device (after a model is dropped); nothing on the CPU."""
        acc = _accelerator(self.type)
        if acc is not None:
            acc.empty_cache()

    def memory_stats(self) -> dict[str, float]:
        """MB figures under the metric names of docs/architecture.md; on CPU all three are process RSS (max = peak RSS)."""
        acc = _accelerator(self.type)
        if acc is None:
            rss = psutil.Process().memory_info().rss / _MB
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
            return {"mem_allocated_mb": rss, "mem_max_allocated_mb": max(peak, rss), "mem_reserved_mb": rss}
        return {
            "mem_allocated_mb": acc.memory_allocated(self.index) / _MB,
            "mem_max_allocated_mb": acc.max_memory_allocated(self.index) / _MB,
            "mem_reserved_mb": acc.memory_reserved(self.index) / _MB,
        }

    def reset_peak_memory(self) -> None:
        acc = _accelerator(self.type)
        if acc is not None:
            acc.reset_peak_memory_stats(self.index)


@functools.cache
def has_fused_adamw(device_type: str) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` runs on this device type: one in-place kernel per parameter list, no
    temporary (CPU and CUDA in torch; NPU when torch_npu registers ``aten::_fused_adamw_`` for PrivateUse1). Probed
    on one element, because a missing kernel only shows at the first ``step()``."""
    if device_type == "npu":
        import_torch_npu()
    device = torch.device(device_type)
    param = torch.zeros(1, device=device, requires_grad=True)
    param.grad = torch.zeros(1, device=device)
    try:
        torch.optim.AdamW([param], fused=True).step()
    except (NotImplementedError, RuntimeError):
        return False
    return True


def _set_hccl_timeouts(connect_s: int | None, exec_s: int | None) -> None:
    # HCCL reads these at communicator creation; an explicit environment wins over the spec (MindSpeed scripts
    # export 3600 for both; CANN defaults are 120 s connect / 1800 s exec, too short while rank 0 tokenizes).
    if connect_s is not None:
        os.environ.setdefault("HCCL_CONNECT_TIMEOUT", str(connect_s))
    if exec_s is not None:
        os.environ.setdefault("HCCL_EXEC_TIMEOUT", str(exec_s))


def init_distributed(
    device_type: DeviceType = "cpu",
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    hccl_connect_timeout_s: int | None = 3600,
    hccl_exec_timeout_s: int | None = 3600,
) -> Device:
    """Pick this rank's device from torchrun's env (RANK, WORLD_SIZE, LOCAL_RANK) and start the process group.

    Without torchrun's variables this is a single process and no group is created. Returns the local device.
    """
    if device_type not in BACKENDS:
        raise ValueError(f"device_type: {device_type!r} is not one of {', '.join(BACKENDS)}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = Device(device_type, local_rank if device_type != "cpu" else 0)
    acc = _accelerator(device_type)
    if acc is not None:
        if local_rank >= acc.device_count():
            raise RuntimeError(f"LOCAL_RANK {local_rank}: only {acc.device_count()} {device_type} devices visible")
        acc.set_device(local_rank)
    if device_type == "npu":
        _set_hccl_timeouts(hccl_connect_timeout_s, hccl_exec_timeout_s)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        device_id = device.torch_device if device_type != "cpu" else None
        dist.init_process_group(backend=device.backend, timeout=timeout, device_id=device_id)
    return device
