"""Helpers for the conversion tests: tiny random transformers Qwen3 checkpoints and MindSpeed-style LoRA checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

VOCAB = 256


def tiny_hf(path: Path, tied: bool, dtype: torch.dtype = torch.float32, layers: int = 4, seed: int = 0) -> Path:
    """A random Qwen3ForCausalLM (every tensor random, norms included) saved with ``save_pretrained``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        tie_word_embeddings=tied,
        max_position_embeddings=256,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.05 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path, max_shard_size="200KB")
    return path


# The shape of the tiny models that run through the service: the real 151936 vocabulary (the real tokenizer's ids)
# but hidden 64 and 2 layers; transformers' own random init.
REAL_VOCAB_SHAPE: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# ``REAL_VOCAB_SHAPE`` as MindSpeed's (Megatron's) model flags, spelled out as a user's script does.
REAL_VOCAB_FLAGS: dict[str, Any] = {
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
}


def real_vocab_qwen3(path: Path, **config: Any) -> Path:
    """A random Qwen3 of ``REAL_VOCAB_SHAPE``, written by transformers itself; ``config`` overrides (e.g. a wider
    ``initializer_range`` for clear argmax margins)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    Qwen3ForCausalLM(Qwen3Config(**{**REAL_VOCAB_SHAPE, **config})).save_pretrained(path)
    return path


def tiny_hf_moe(path: Path, **config: Any) -> Path:
    """A random Qwen3-MoE written by transformers: 2 layers, both MoE, of 4 experts (top-2, normalised), GQA 4/2 heads
    of 16; ``config`` sets the rest (vocabulary, widths) or overrides."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    base: dict[str, Any] = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
    }
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**base, **config})).save_pretrained(path)
    return path


def real_vocab_qwen3_moe(path: Path) -> Path:
    """``tiny_hf_moe`` of ``REAL_VOCAB_SHAPE`` with expert FFN 32."""
    return tiny_hf_moe(path, **REAL_VOCAB_SHAPE, moe_intermediate_size=32)


def read_hf(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def json_objects(text: str) -> list[dict]:
    """Every JSON object printed by the ranks (their lines may run together on one line)."""
    decoder, found, i = json.JSONDecoder(), [], text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
            found.append(obj)
            i = text.find("{", end)
        except ValueError:
            i = text.find("{", i + 1)
    return found
