"""Model shape: built from an HF ``config.json``, a named preset, or a spec's Megatron flags."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

QWEN3_VOCAB = 151936


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Qwen3 dense shape. Names follow Megatron flags; ``to_hf``/``from_hf`` map to ``Qwen3Config``."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # head dim; Qwen3 sets it explicitly (128), not hidden / heads
    vocab_size: int = QWEN3_VOCAB  # padded vocab: rows of the embedding and output matrices
    norm_epsilon: float = 1e-6
    rotary_base: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused ``linear_qkv`` weight: per group, its q heads then one k and one v head."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    def num_params(self, include_embedding: bool = True) -> int:
        h, d = self.hidden_size, self.kv_channels
        attn = h * self.qkv_rows + self.num_attention_heads * d * h + 2 * d
        mlp = 3 * h * self.ffn_hidden_size
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + h + (emb if include_embedding else 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        heads = hf["num_attention_heads"]
        return cls(
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            rotary_base=float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 1e6)),
            max_position_embeddings=hf.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_method_std=hf.get("initializer_range", 0.02),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file}: no config.json in the HF model directory")
        return cls.from_hf(json.loads(config_file.read_text()))

    def to_hf(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A ``config.json`` that ``transformers.Qwen3ForCausalLM`` loads."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "head_dim": self.kv_channels,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.init_method_std,
            "intermediate_size": self.ffn_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_query_groups,
            "rms_norm_eps": self.norm_epsilon,
            "rope_scaling": None,
            "rope_theta": self.rotary_base,
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _preset(layers: int, hidden: int, ffn: int, heads: int, groups: int, tied: bool, **kw: Any) -> ModelConfig:
    return ModelConfig(layers, hidden, ffn, heads, groups, kw.pop("kv_channels", 128), tie_word_embeddings=tied, **kw)


# Shapes of the published Qwen3 dense checkpoints (their config.json files).
PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": _preset(28, 1024, 3072, 16, 8, True),
    "qwen3-1.7b": _preset(28, 2048, 6144, 16, 8, True),
    "qwen3-4b": _preset(36, 2560, 9728, 32, 8, True),
    "qwen3-8b": _preset(36, 4096, 12288, 32, 8, False),
    "qwen3-14b": _preset(40, 5120, 17408, 40, 8, False),
    "qwen3-32b": _preset(64, 5120, 25600, 64, 8, False),
    # For tests: the real vocabulary (so the real tokenizer works), everything else tiny.
    "qwen3-tiny": _preset(2, 64, 128, 4, 2, False, kv_channels=16, max_position_embeddings=2048),
    "qwen3-tiny-tied": _preset(2, 64, 128, 4, 2, True, kv_channels=16, max_position_embeddings=2048),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
