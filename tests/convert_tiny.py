"""Helpers for the conversion tests: tiny random transformers Qwen3 checkpoints and MindSpeed-style LoRA checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

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
