"""HF Qwen3 <-> native (Megatron mcore local-spec) tensor names and layouts, one tensor at a time.

Native state-dict keys are exactly Megatron-Core's local-spec keys for TP=1, PP=1 with global layer indices
(``shared/docs/megatron-interop.md`` §2), so a native checkpoint *is* an unsharded mcore ``model`` dict:

    embedding.word_embeddings.weight                      <- model.embed_tokens.weight
    decoder.layers.{i}.input_layernorm.weight             <- model.layers.{i}.input_layernorm.weight
    decoder.layers.{i}.self_attention.linear_qkv.weight   <- q_proj, k_proj, v_proj interleaved per KV group
    decoder.layers.{i}.self_attention.q_layernorm.weight  <- ...self_attn.q_norm.weight
    decoder.layers.{i}.self_attention.k_layernorm.weight  <- ...self_attn.k_norm.weight
    decoder.layers.{i}.self_attention.linear_proj.weight  <- ...self_attn.o_proj.weight
    decoder.layers.{i}.pre_mlp_layernorm.weight           <- ...post_attention_layernorm.weight
    decoder.layers.{i}.mlp.linear_fc1.weight              <- [gate_proj; up_proj]
    decoder.layers.{i}.mlp.linear_fc2.weight              <- ...mlp.down_proj.weight
    decoder.final_layernorm.weight                        <- model.norm.weight
    output_layer.weight                                   <- lm_head.weight (absent when embeddings are tied)

The functions are generators over a ``get(name) -> Tensor`` callback so that converters can stream from
memory-mapped safetensors and never hold the whole model.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from engine.model.config import ModelConfig

Getter = Callable[[str], torch.Tensor]

# native suffix (under decoder.layers.{i}.) -> HF suffix (under model.layers.{i}.) for tensors copied unchanged
LAYER_COPIES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[q; k; v] per KV group: for group g, its heads' q rows, then k head g, then v head g."""
    ng, d, h = cfg.num_query_groups, cfg.kv_channels, q.shape[-1]
    q = q.reshape(ng, cfg.heads_per_group * d, h)  # (ng, nh/ng*d, H)
    k = k.reshape(ng, d, h)
    v = v.reshape(ng, d, h)
    return torch.cat([q, k, v], dim=1).reshape(-1, h)


def split_qkv(w: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``; works on a TP shard too when ``cfg`` carries the shard's group count."""
    d, h = cfg.kv_channels, w.shape[-1]
    per_group = (cfg.heads_per_group + 2) * d
    g = w.reshape(-1, per_group, h)
    q, k, v = torch.split(g, [cfg.heads_per_group * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def split_fc1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(w, 2, dim=0)
    return gate, up


def native_keys(cfg: ModelConfig) -> list[str]:
    """Every native key of the full model, in order."""
    keys = ["embedding.word_embeddings.weight"]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        keys += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        keys += [p + s for s in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
                                 "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight")]
        keys += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    keys.append("decoder.final_layernorm.weight")
    if not cfg.tie_word_embeddings:
        keys.append("output_layer.weight")
    return keys


def native_from_hf(get: Getter, cfg: ModelConfig, layers: Iterable[int] | None = None,
                   embedding: bool = True, head: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (native key, tensor) for the chosen parts of the model, reading HF tensors through ``get``."""
    if embedding:
        yield "embedding.word_embeddings.weight", get("model.embed_tokens.weight")
    for i in range(cfg.num_layers) if layers is None else layers:
        n, f = f"decoder.layers.{i}.", f"model.layers.{i}."
        for ns, hs in LAYER_COPIES.items():
            yield n + ns, get(f + hs)
        yield n + "self_attention.linear_qkv.weight", fuse_qkv(
            get(f + "self_attn.q_proj.weight"), get(f + "self_attn.k_proj.weight"), get(f + "self_attn.v_proj.weight"), cfg
        )
        yield n + "mlp.linear_fc1.weight", fuse_fc1(get(f + "mlp.gate_proj.weight"), get(f + "mlp.up_proj.weight"))
    if head:
        yield "decoder.final_layernorm.weight", get("model.norm.weight")
        if not cfg.tie_word_embeddings:
            yield "output_layer.weight", get("lm_head.weight")


def hf_from_native(get: Getter, cfg: ModelConfig, layers: Iterable[int] | None = None,
                   embedding: bool = True, head: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF key, tensor), reading native tensors through ``get``. Tied models get no ``lm_head.weight``."""
    if embedding:
        yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")
    for i in range(cfg.num_layers) if layers is None else layers:
        n, f = f"decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = split_qkv(get(n + "self_attention.linear_qkv.weight"), cfg)
        yield f + "self_attn.q_proj.weight", q
        yield f + "self_attn.k_proj.weight", k
        yield f + "self_attn.v_proj.weight", v
        gate, up = split_fc1(get(n + "mlp.linear_fc1.weight"))
        yield f + "mlp.gate_proj.weight", gate
        yield f + "mlp.up_proj.weight", up
        for ns, hs in LAYER_COPIES.items():
            yield f + hs, get(n + ns)
    if head:
        yield "model.norm.weight", get("decoder.final_layernorm.weight")
        if not cfg.tie_word_embeddings:
            yield "lm_head.weight", get("output_layer.weight")
