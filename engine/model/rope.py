"""Rotary tables: cos/sin for given positions, plain RoPE or YaRN-scaled (``engine.contract.rope_scaling`` holds the
torch-free settings). Computed in fp32 and cast, as transformers' ``Qwen3RotaryEmbedding`` does."""

from __future__ import annotations

import torch

from engine.contract import rope_scaling
from engine.contract.model_config import ModelConfig

Rope = tuple[torch.Tensor, torch.Tensor]


def inverse_frequencies(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """(head_dim / 2,) fp32 inverse frequencies; under YaRN each dimension blends the original frequency
    (extrapolation, fast-rotating dimensions) and the frequency divided by the factor (interpolation, slow ones)
    along a linear ramp over ``rope_scaling.correction_range``."""
    dim = cfg.kv_channels
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    pos_freqs = cfg.rotary_base**exponent
    if cfg.rope_scaling_type is None:
        return 1.0 / pos_freqs
    low, high = rope_scaling.correction_range(cfg, dim)
    if low == high:
        high += 0.001  # the ramp's width must not be zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (cfg.rope_scaling_factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation


def rope_cos_sin(position_ids: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> Rope:
    """cos/sin tables (B, T, head_dim) for the given positions, computed in fp32 (YaRN's attention factor applied)."""
    inv_freq = inverse_frequencies(cfg, position_ids.device)  # (d/2,)
    freqs = position_ids[..., None].float() * inv_freq  # (B, T, d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, d)
    scale = rope_scaling.attention_factor(cfg)
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
