"""The small Qwen3 the CPU training and serving benchmarks run (a helper of ``bench/``, not a benchmark): hidden 512,
8 layers, 8 heads / 4 KV groups of 64, FFN 1536, the real 151,936 vocabulary, tied embeddings; ``SMOKE_SHAPE`` is
its one-layer hidden-64 stand-in. Shapes in Hugging Face's ``Qwen3Config`` names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
SMOKE_SHAPE: dict[str, Any] = {
    **SHAPE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def write_model(out: Path, shape: dict[str, Any], seed: int, **config: Any) -> Path:
    """A random fp32 Qwen3 of ``shape`` (``config``: other ``Qwen3Config`` fields), saved as an HF directory."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**shape, **config)).to(torch.float32).save_pretrained(out)
    return out


def write_side_models(work: Path, sides: tuple[str, ...], shape: dict[str, Any], seed: int, **config: Any) -> None:
    """The same random weights in each side's own directory, ``work/<side>/model``."""
    for side in sides:
        (work / side).mkdir()
        write_model(work / side / "model", shape, seed, **config)
