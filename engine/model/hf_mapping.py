"""HF Qwen3 <-> native (Megatron mcore local-spec) tensor names and layouts, one tensor at a time.

Native state-dict keys are exactly Megatron-Core's local-spec keys for TP=1, PP=1 with global layer indices
(``docs/megatron-interop.md`` §2), so a native checkpoint *is* an unsharded mcore ``model`` dict:

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

MoE layers (Qwen3-MoE; ``cfg.is_moe_layer(i)``) have, instead of the dense ``mlp.linear_fc1/fc2``:

    decoder.layers.{i}.mlp.router.weight              (E, H)       <- model.layers.{i}.mlp.gate.weight
    decoder.layers.{i}.mlp.experts.linear_fc1.weight  (E, 2F, H)   <- stack_e [experts.{e}.gate_proj; .up_proj]
    decoder.layers.{i}.mlp.experts.linear_fc2.weight  (E, H, F)    <- stack_e experts.{e}.down_proj

(the published checkpoints' per-expert names, which transformers also writes; ``MOE_LAYER_MAP``, whose rules depend
on the expert count).

This module is the ONE place the rules are written: ``LAYER_MAP`` / ``TOP_MAP`` say which HF tensors make each native
tensor and how (``fuse_qkv``: per-KV-group interleave; ``fuse_fc1``: ``[gate; up]``), and everything else derives
from them: the tensor path (``native_tensor``, ``native_from_hf``, ``hf_from_native``), the row plans of the
byte-range fast paths (``native_row_runs`` here for HF -> native; ``fastcopy.RowPlan`` runs ``hf_from_native`` on
row numbers for native -> HF) and LoRA's module correspondence (``HF_MODULES``). The functions work over a
``get(name) -> Tensor`` callback so that converters can stream from the files and never hold the whole model.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator

import torch

from engine.contract.model_config import ModelConfig

Getter = Callable[[str], torch.Tensor]


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


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor, cfg: ModelConfig | None = None) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def split_fc1(w: torch.Tensor, cfg: ModelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(w, 2, dim=0)
    return gate, up


def _one(t: torch.Tensor, cfg: ModelConfig | None = None) -> torch.Tensor:
    return t


def _unpack(t: torch.Tensor, cfg: ModelConfig | None = None) -> tuple[torch.Tensor]:
    return (t,)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One native tensor made of ``hf`` tensors (suffixes under ``model.layers.{i}.`` for layer rules):
    ``fuse(*hf_tensors, cfg)`` builds it, ``split(native, cfg)`` gives the HF tensors back in ``hf`` order."""

    hf: tuple[str, ...]
    fuse: Callable[..., torch.Tensor] = _one
    split: Callable[..., tuple[torch.Tensor, ...]] = _unpack


# native suffix under decoder.layers.{i}. -> its rule, in the model's parameter order
LAYER_MAP: dict[str, Rule] = {
    "input_layernorm.weight": Rule(("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": Rule(
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), fuse_qkv, split_qkv
    ),
    "self_attention.q_layernorm.weight": Rule(("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": Rule(("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": Rule(("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": Rule(("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": Rule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), fuse_fc1, split_fc1),
    "mlp.linear_fc2.weight": Rule(("mlp.down_proj.weight",)),
}


def _fuse_experts_fc1(*parts: torch.Tensor | ModelConfig) -> torch.Tensor:
    """(gate_0, up_0, gate_1, up_1, ..., cfg) -> (E, 2F, H): per expert ``[gate; up]``, stacked."""
    t = [p for p in parts if isinstance(p, torch.Tensor)]
    return torch.stack([torch.cat(t[i : i + 2]) for i in range(0, len(t), 2)])


def _split_experts_fc1(w: torch.Tensor, cfg: ModelConfig | None = None) -> tuple[torch.Tensor, ...]:
    return tuple(half for e in w.unbind(0) for half in e.chunk(2))


def _stack(*parts: torch.Tensor | ModelConfig) -> torch.Tensor:
    return torch.stack([p for p in parts if isinstance(p, torch.Tensor)])


def _unstack(w: torch.Tensor, cfg: ModelConfig | None = None) -> tuple[torch.Tensor, ...]:
    return tuple(w.unbind(0))


DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
ROUTER, EXPERT_FC1, EXPERT_FC2 = "mlp.router.weight", "mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight"


def expert_hf(e: int, proj: str) -> str:
    """HF suffix (under ``model.layers.{i}.``) of expert ``e``'s ``proj`` (gate_proj, up_proj, down_proj)."""
    return f"mlp.experts.{e}.{proj}.weight"


@functools.cache
def moe_layer_map(num_experts: int) -> dict[str, Rule]:
    """The rules of an MoE layer's MLP tensors (native suffix -> rule), in the model's parameter order."""
    return {
        ROUTER: Rule(("mlp.gate.weight",)),
        EXPERT_FC1: Rule(
            tuple(expert_hf(e, p) for e in range(num_experts) for p in ("gate_proj", "up_proj")),
            _fuse_experts_fc1,
            _split_experts_fc1,
        ),
        EXPERT_FC2: Rule(tuple(expert_hf(e, "down_proj") for e in range(num_experts)), _stack, _unstack),
    }


def layer_rules(cfg: ModelConfig, layer: int) -> dict[str, Rule]:
    """Native suffix -> rule of every tensor of decoder layer ``layer``, in the model's parameter order."""
    if not cfg.is_moe_layer(layer):
        return LAYER_MAP
    rules = {k: r for k, r in LAYER_MAP.items() if k not in DENSE_MLP}
    return {**rules, **moe_layer_map(cfg.num_experts or 0)}


def layer_rule(suffix: str, cfg: ModelConfig) -> Rule:
    """The rule of a layer tensor by its suffix (KeyError for a suffix no layer has)."""
    if suffix in LAYER_MAP:
        return LAYER_MAP[suffix]
    if cfg.is_moe:
        return moe_layer_map(cfg.num_experts or 0)[suffix]
    raise KeyError(suffix)


# native key outside the layers -> its rule (full HF keys); a tied model's head is the embedding
TOP_MAP: dict[str, Rule] = {
    "embedding.word_embeddings.weight": Rule(("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": Rule(("model.norm.weight",)),
    "output_layer.weight": Rule(("lm_head.weight",)),
}
# tensors copied unchanged (native suffix -> HF suffix), and adapted native modules -> their HF modules (LoRA/PEFT)
LAYER_COPIES = {n: r.hf[0] for n, r in LAYER_MAP.items() if len(r.hf) == 1}
HF_MODULES = {
    n.removesuffix(".weight"): tuple(h.removesuffix(".weight") for h in r.hf)
    for n, r in LAYER_MAP.items()
    if n.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight"))
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def rule_of(key: str, cfg: ModelConfig) -> tuple[tuple[str, ...], Rule]:
    """(full HF keys, rule) of native ``key``; KeyError for a key the model does not have."""
    m = _LAYER_RE.match(key)
    if m:
        rule = layer_rule(m[2], cfg)
        return tuple(f"model.layers.{m[1]}.{h}" for h in rule.hf), rule
    if key == "output_layer.weight" and cfg.tie_word_embeddings:
        key = "embedding.word_embeddings.weight"
    rule = TOP_MAP[key]
    return rule.hf, rule


def native_tensor(key: str, get: Getter, cfg: ModelConfig) -> torch.Tensor:
    """Native ``key`` built from HF tensors read through ``get``."""
    hf_keys, rule = rule_of(key, cfg)
    return rule.fuse(*(get(k) for k in hf_keys), cfg)


def native_row_runs(
    key: str, cfg: ModelConfig, hf_rows: Callable[[str], int], shard: Callable[[torch.Tensor], torch.Tensor] = _one
) -> list[tuple[str, int, int]]:
    """The rows of native ``key`` (cut by ``shard``, e.g. one TP rank's piece) as runs ``(hf_key, start, stop)`` of
    HF rows, in order: the rule run on row numbers instead of weights, so the layout is never written twice."""
    hf_keys, rule = rule_of(key, cfg)
    bases, base = [], 0
    for k in hf_keys:
        bases.append(base)
        base += hf_rows(k)
    ids = rule.fuse(
        *(torch.arange(b, b + hf_rows(k), dtype=torch.int64).unsqueeze(1) for b, k in zip(bases, hf_keys, strict=True)),
        cfg,
    )
    ids = shard(ids).reshape(-1)
    runs: list[tuple[str, int, int]] = []
    if ids.numel() == 0:
        return runs
    tensor = torch.zeros_like(ids)  # which HF tensor each row comes from
    for b in bases[1:]:
        tensor += ids >= b
    cut = (ids[1:] - ids[:-1] != 1) | (tensor[1:] != tensor[:-1])
    breaks = (torch.nonzero(cut).reshape(-1) + 1).tolist()
    for lo, hi in zip([0] + breaks, breaks + [ids.numel()], strict=True):
        j = int(tensor[lo])
        runs.append((hf_keys[j], int(ids[lo]) - bases[j], int(ids[hi - 1]) + 1 - bases[j]))
    return runs


def native_keys(cfg: ModelConfig) -> list[str]:
    """Every native key of the full model, in the model's parameter order."""
    return _part_keys(cfg, None, embedding=True, head=True)


def _part_keys(cfg: ModelConfig, layers: Iterable[int] | None, embedding: bool, head: bool) -> list[str]:
    keys = ["embedding.word_embeddings.weight"] if embedding else []
    for i in range(cfg.num_layers) if layers is None else layers:
        keys += [f"decoder.layers.{i}.{s}" for s in layer_rules(cfg, i)]
    if head:
        keys.append("decoder.final_layernorm.weight")
        if not cfg.tie_word_embeddings:
            keys.append("output_layer.weight")
    return keys


def native_from_hf(
    get: Getter, cfg: ModelConfig, layers: Iterable[int] | None = None, embedding: bool = True, head: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (native key, tensor) for the chosen parts of the model, reading HF tensors through ``get``."""
    for key in _part_keys(cfg, layers, embedding, head):
        yield key, native_tensor(key, get, cfg)


def hf_from_native(
    get: Getter, cfg: ModelConfig, layers: Iterable[int] | None = None, embedding: bool = True, head: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF key, tensor), reading native tensors through ``get``. Tied models get no ``lm_head.weight``."""

    def order(item: tuple[int, str]) -> tuple[int, int]:
        # Per layer the fused tensors first (the order our HF files have always had): q k v gate up, then copies.
        m = _LAYER_RE.match(item[1])
        return (int(m[1]), len(layer_rule(m[2], cfg).hf) == 1) if m else (-1 if item[0] == 0 else 1 << 30, 0)

    for _, key in sorted(enumerate(_part_keys(cfg, layers, embedding, head)), key=order):
        hf_keys, rule = rule_of(key, cfg)
        yield from zip(hf_keys, rule.split(get(key), cfg), strict=True)
