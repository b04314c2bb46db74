"""A random tiny transformers Qwen3MoeForCausalLM and our model loaded from it (shared by the MoE tests)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from convert_tiny import tiny_hf_moe
from engine.contract.model_config import ModelConfig
from engine.model import moe_mapping
from engine.model.qwen3 import Qwen3Model

VOCAB = 256
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def hf_config(**overrides: object) -> Qwen3MoeConfig:
    """3 layers (layer 1 dense), 8 experts top-2, GQA 4/2 heads with head_dim != hidden / heads."""
    kw: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "rope_theta": 10000.0,
        "initializer_range": 0.1,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    kw.update(overrides)
    return Qwen3MoeConfig(**kw, attn_implementation="eager")


def disk_getter(tensors: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """Published-checkpoint names (``experts.{e}.gate_proj.weight``…) served from transformers' in-memory fused
    ``experts.gate_up_proj`` (E, 2F, H) and ``experts.down_proj`` (E, H, F)."""

    def get(name: str) -> torch.Tensor:
        m = _EXPERT.fullmatch(name)
        if m is None:
            return tensors[name]
        base, e, which = m.group(1), int(m.group(2)), m.group(3)
        if which == "down":
            return tensors[base + ".down_proj"][e]
        gate, up = tensors[base + ".gate_up_proj"][e].chunk(2)
        return gate if which == "gate" else up

    return get


def hf_pair(seed: int = 0, **overrides: object) -> tuple[Qwen3MoeForCausalLM, Qwen3Model]:
    """A random HF MoE model (random norms, a wide router so tokens spread over the experts) and ours from it."""
    torch.manual_seed(seed)
    hf = Qwen3MoeForCausalLM(hf_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    ours = Qwen3Model(cfg)
    ours.load_state_dict(dict(moe_mapping.native_from_hf(disk_getter(hf.state_dict()), cfg)), strict=True)
    return hf, ours.eval()


def write_hf_moe_dir(path: Path) -> Path:
    """A random tiny Qwen3-MoE written by transformers (``tiny_hf_moe``: 2 MoE layers, 4 experts top-2; hidden 32,
    vocab 512), seeded."""
    torch.manual_seed(0)
    return tiny_hf_moe(
        path,
        vocab_size=512,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        max_position_embeddings=256,
    )
