"""Which fused attention kernel a device type offers, probed without touching the model.

Part of the device layer (``engine.parallel.device`` chooses devices and backends), kept in the model package because
the attention module asks it at run time and ``engine.parallel`` imports the model: one direction, no cycle.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Literal

import torch

AttentionKernel = Literal["sdpa", "torch_varlen", "flash_varlen", "npu_fusion"]


def attention_kernel(device_type: str) -> AttentionKernel:
    """The fused attention used for packed (varlen) training batches on this device type.

    npu: ``torch_npu.npu_fusion_attention`` (TND layout) when torch_npu is loaded — an NPU tensor implies it is.
    cuda (Ampere or newer): torch's own ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside torch),
    else ``flash_attn.flash_attn_varlen_func`` when the flash-attn package is installed. Everything else, and every
    batch with padding or a KV cache, goes through ``scaled_dot_product_attention`` (which itself picks the flash
    kernel on CUDA for plain causal batches).
    """
    if device_type == "npu":
        npu = sys.modules.get("torch_npu")
        return "npu_fusion" if npu is not None and hasattr(npu, "npu_fusion_attention") else "sdpa"
    if device_type != "cuda" or not _cuda_has_flash():
        return "sdpa"
    if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        return "torch_varlen"
    return "flash_varlen" if importlib.util.find_spec("flash_attn") is not None else "sdpa"


_NPU_FUSED = ("npu_rms_norm", "npu_swiglu", "npu_rotary_mul")


def npu_fused_ops(device_type: str) -> ModuleType | None:
    """``torch_npu`` when the device type is npu and it offers the fused RMSNorm, SwiGLU and RoPE kernels
    (``engine.model.lean_ops`` runs them); None elsewhere, where the same math runs in plain torch."""
    if device_type != "npu":
        return None
    npu = sys.modules.get("torch_npu")
    return npu if npu is not None and all(hasattr(npu, op) for op in _NPU_FUSED) else None


def _cuda_has_flash() -> bool:
    # FlashAttention-2 kernels need compute capability 8.0 (A100) or newer
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
