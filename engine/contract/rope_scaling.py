"""RoPE scaling (YaRN) settings, torch-free: read from an HF ``config.json``, a Megatron checkpoint's ``args`` or a
spec's flags, written back to each, and the longest position a scaled model reaches.

Names are MindSpeed-LLM's flags (``--rope-scaling-type yarn``, ``--rope-scaling-factor``,
``--rope-scaling-original-max-position-embeddings``, ``--rope-scaling-beta-fast``/``--rope-scaling-beta-slow``,
``--rope-scaling-mscale``/``--rope-scaling-mscale-all-dim``); HF's ``rope_scaling`` (or transformers 5's
``rope_parameters``) dict uses ``rope_type``, ``factor``, ``original_max_position_embeddings``, ``beta_fast``,
``beta_slow``, ``mscale``, ``mscale_all_dim`` and ``attention_factor``. The arithmetic follows the YaRN paper as
transformers implements it (``engine.model.rope`` computes the tables; parity with transformers is a test).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

SUPPORTED = ("yarn",)

# ModelConfig field -> key in HF's rope_scaling dict
HF_KEYS: dict[str, str] = {
    "rope_scaling_factor": "factor",
    "rope_scaling_original_max_position_embeddings": "original_max_position_embeddings",
    "rope_scaling_beta_fast": "beta_fast",
    "rope_scaling_beta_slow": "beta_slow",
    "rope_scaling_mscale": "mscale",
    "rope_scaling_mscale_all_dim": "mscale_all_dim",
    "rope_scaling_attention_factor": "attention_factor",
}
FIELDS = ("rope_scaling_type", *HF_KEYS)
DEFAULTS = {"rope_scaling_beta_fast": 32.0, "rope_scaling_beta_slow": 1.0}  # transformers' and MindSpeed's


class RopeConfig(Protocol):
    """The RoPE fields of a model shape (``engine.contract.model_config.ModelConfig`` has them; that module imports
    this one, so the shape is named here)."""

    @property
    def rotary_base(self) -> float: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def rope_scaling_type(self) -> str | None: ...
    @property
    def rope_scaling_factor(self) -> float: ...
    @property
    def rope_scaling_original_max_position_embeddings(self) -> int | None: ...
    @property
    def rope_scaling_beta_fast(self) -> float: ...
    @property
    def rope_scaling_beta_slow(self) -> float: ...
    @property
    def rope_scaling_mscale(self) -> float | None: ...
    @property
    def rope_scaling_mscale_all_dim(self) -> float | None: ...
    @property
    def rope_scaling_attention_factor(self) -> float | None: ...


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig rope-scaling fields from a ``config.json`` ({} when it has none or only the default rope)."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return {}
    if kind not in SUPPORTED:
        raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (only {', '.join(SUPPORTED)})")
    fields: dict[str, Any] = {"rope_scaling_type": kind}
    for field, key in HF_KEYS.items():
        if scaling.get(key) is not None:
            fields[field] = scaling[key]
    if "rope_scaling_factor" not in fields and fields.get("rope_scaling_original_max_position_embeddings"):
        # transformers' rule when factor is absent: the stretch from the original to the configured positions
        fields["rope_scaling_factor"] = (
            hf["max_position_embeddings"] / fields["rope_scaling_original_max_position_embeddings"]
        )
    return fields


def to_hf(cfg: RopeConfig) -> dict[str, Any] | None:
    """HF's ``rope_scaling`` dict for ``cfg`` (None without scaling), as Qwen3's model cards write it."""
    if cfg.rope_scaling_type is None:
        return None
    out: dict[str, Any] = {"rope_type": cfg.rope_scaling_type}
    for field, key in HF_KEYS.items():
        value = getattr(cfg, field)
        if value is not None and value != DEFAULTS.get(field):
            out[key] = value
    return out


def from_args(args: object) -> dict[str, Any]:
    """ModelConfig rope-scaling fields from a Megatron checkpoint's ``args`` (MindSpeed's names; {} if none)."""
    a = dict(getattr(args, "__dict__", None) or {})
    if a.get("rope_scaling_type") in (None, "", "default"):
        return {}
    return {field: a[field] for field in FIELDS if a.get(field) is not None}


def from_flags(spec: object) -> dict[str, Any]:
    """ModelConfig rope-scaling fields a spec sets (each flag overrides the checkpoint's value; {} if none). ``spec``
    is any object with the ``rope_scaling_*`` flags as attributes (``engine.contract.spec.ModelArgs``): this module
    sits below the spec package, which imports it, so it names no spec class (a spec lacks some of ``FIELDS``)."""
    return {field: getattr(spec, field) for field in FIELDS if getattr(spec, field, None) is not None}


def check(cfg: RopeConfig) -> None:
    """Raise ValueError naming the field when ``cfg``'s rope-scaling fields cannot describe a YaRN model."""
    if cfg.rope_scaling_type is None:
        return
    if cfg.rope_scaling_type not in SUPPORTED:
        raise ValueError(f"rope_scaling_type: {cfg.rope_scaling_type!r} is not supported (only yarn)")
    if not cfg.rope_scaling_original_max_position_embeddings:
        raise ValueError(
            "rope_scaling_original_max_position_embeddings: required with rope_scaling_type yarn (the context "
            "length the model was pre-trained at)"
        )
    if cfg.rope_scaling_factor is None or cfg.rope_scaling_factor < 1:
        raise ValueError(f"rope_scaling_factor: must be >= 1 with yarn, got {cfg.rope_scaling_factor}")


def _original(cfg: RopeConfig) -> int:
    """The pre-trained length YaRN stretches (``check`` refuses a scaled config without it)."""
    if not cfg.rope_scaling_original_max_position_embeddings:
        raise ValueError("rope_scaling_original_max_position_embeddings: required with rope_scaling_type yarn")
    return cfg.rope_scaling_original_max_position_embeddings


def max_positions(cfg: RopeConfig) -> int:
    """The longest position ``cfg`` reaches: ``max_position_embeddings``, or with YaRN the original length
    stretched by the factor when that is longer (Qwen3 keeps 40,960 in its config and reaches 131,072)."""
    if cfg.rope_scaling_type is None:
        return int(cfg.max_position_embeddings)
    stretched = int(_original(cfg) * cfg.rope_scaling_factor)
    return max(int(cfg.max_position_embeddings), stretched)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(cfg: RopeConfig) -> float:
    """The factor YaRN multiplies cos/sin by (the paper's ``sqrt(1/t)``; 1.0 without scaling)."""
    if cfg.rope_scaling_type is None:
        return 1.0
    if cfg.rope_scaling_attention_factor is not None:
        return float(cfg.rope_scaling_attention_factor)
    factor, m, m_all = cfg.rope_scaling_factor, cfg.rope_scaling_mscale, cfg.rope_scaling_mscale_all_dim
    if m and m_all:
        return _mscale(factor, m) / _mscale(factor, m_all)
    return _mscale(factor)


def correction_range(cfg: RopeConfig, dim: int) -> tuple[float, float]:
    """YaRN's band of rotary dimensions between extrapolation (fast) and interpolation (slow), truncated to whole
    dimensions as transformers does by default."""

    def dim_at(rotations: float) -> float:
        return (dim * math.log(_original(cfg) / (rotations * 2 * math.pi))) / (2 * math.log(cfg.rotary_base))

    low = math.floor(dim_at(cfg.rope_scaling_beta_fast))
    high = math.ceil(dim_at(cfg.rope_scaling_beta_slow))
    return max(low, 0), min(high, dim - 1)
