"""How native (Megatron local-spec, TP1/PP1) tensors are cut into Megatron's TP/PP ranks, and glued back.

Facts from ``docs/megatron-interop.md`` §2:

- column-parallel weights (``linear_qkv``, word embeddings, ``output_layer``) are chunked on dim 0; ``linear_qkv``
  is interleaved per KV group, so a plain dim-0 chunk hands each rank ``ng/TP`` whole groups;
- ``linear_fc1`` is ``[gate; up]`` and rank k holds ``[gate_k; up_k]`` ("glu" rule);
- row-parallel weights (``linear_proj``, ``linear_fc2``) are chunked on dim 1; norms are replicated;
- LoRA (MindSpeed ``lora_moe.py``): on column-parallel targets A is replicated and B is split like the base weight;
  on row-parallel targets A is split like the base weight (dim 1) and B is replicated;
- MoE (MindSpeed-LLM ``convert_hf2mg.py``, Megatron ``experts.py``; docs/megatron-moe.md): the router is
  replicated; each expert's fc1 is cut like the dense ``linear_fc1`` ([gate_k; up_k]) and its fc2 on its input dim,
  so on the stacked native tensors (E, 2F, H) / (E, H, F) the dense rules apply to the last two dims. Expert-parallel
  rank e holds experts [e*E/EP, (e+1)*E/EP) in ``mp_rank_TT[_PPP]_EEE`` (every other tensor is copied into each EP
  rank's file), as ``local_experts.{i}.linear_fc1/fc2.weight`` (SequentialMLP) or, with ``--moe-grouped-gemm``
  (GroupedMLP), ``weight1`` (H, El*2F/TP) and ``weight2`` (El*F/TP, H) whose memory is the per-expert transposed
  pieces (El, H, 2F/TP) / (El, F/TP, H) stacked (Megatron's forward ``view``s them so);
- PP stage p holds a contiguous run of layers renumbered from 0; with virtual pipeline chunk v of stage p holds
  layers starting at ``(v*PP + p) * Lv``; the embedding is on the first stage, the final norm and ``output_layer``
  on the last (a tied model gets a copy of the embedding there when PP > 1).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

import torch

from engine.contract import layout
from engine.contract.model_config import ModelConfig
from engine.model.hf_mapping import EXPERT_FC1, EXPERT_FC2, ROUTER, layer_rules, native_keys

Rule = Literal["rep", "dim0", "dim1", "glu"]

_COLUMN = ("linear_qkv", "linear_fc1")  # module basenames; experts' ``mlp.experts.linear_fc1`` is column-parallel too
_ROW = ("linear_proj", "linear_fc2")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
LORA_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[ABab])(?:\.default)?\.weight$")

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"


def split_rule(key: str) -> Rule:
    """How the tensor ``key`` (any layer index, base or LoRA; dense or per-expert) is divided among TP ranks. The
    rule names dims of one (out, in) matrix: on stacked experts (E, out, in) ``shard``/``merge`` apply it per expert."""
    lora = LORA_RE.match(key)
    if lora:
        module, ab = lora["module"], lora["ab"].upper()
        column = _basename(module) in _COLUMN
        if ab == "A":
            return "rep" if column else "dim1"
        return ("glu" if _basename(module) == "linear_fc1" else "dim0") if column else "rep"
    if key in (EMBEDDING, OUTPUT):
        return "dim0"
    module = _basename(key.removesuffix(".weight"))
    if module == "linear_qkv":
        return "dim0"
    if module == "linear_fc1":
        return "glu"
    if module in _ROW:
        return "dim1"
    return "rep"  # norms, the MoE router


def _basename(module: str) -> str:
    return module.rpartition(".")[2]


def rule_dim(rule: Rule, ndim: int) -> int:
    """The dim ``rule`` cuts in a tensor of ``ndim`` dims: the matrix's out (dim0, glu) or in (dim1) dim, counted
    from the end so that stacked experts (E, out, in) are cut per expert."""
    return max(ndim - 2, 0) if rule in ("dim0", "glu") else ndim - 1


def shard(t: torch.Tensor, rule: Rule, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of the full tensor ``t`` (may be a view: ``.contiguous().clone()`` before ``torch.save``,
    which would otherwise write the whole underlying storage)."""
    if rule == "rep" or tp == 1:
        return t
    dim = rule_dim(rule, t.dim())
    if rule == "glu":
        gate, up = torch.chunk(t, 2, dim=dim)
        return torch.cat([torch.chunk(gate, tp, dim)[rank], torch.chunk(up, tp, dim)[rank]], dim=dim)
    if t.shape[dim] % tp:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} is not divisible by TP {tp}")
    return torch.chunk(t, tp, dim)[rank]


def merge(shards: list[torch.Tensor], rule: Rule) -> torch.Tensor:
    """Inverse of ``shard``: the full tensor from every TP rank's piece, in rank order."""
    if rule == "rep" or len(shards) == 1:
        return shards[0]
    dim = rule_dim(rule, shards[0].dim())
    if rule == "glu":
        halves = [torch.chunk(s, 2, dim=dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(shards, dim=dim)


def native_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every native (TP1) tensor of the model described by ``cfg``."""
    h, d = cfg.hidden_size, cfg.kv_channels
    per_layer = {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (cfg.qkv_rows, h),
        "self_attention.q_layernorm.weight": (d,),
        "self_attention.k_layernorm.weight": (d,),
        "self_attention.linear_proj.weight": (h, cfg.num_attention_heads * d),
        "pre_mlp_layernorm.weight": (h,),
        "mlp.linear_fc1.weight": (2 * cfg.ffn_hidden_size, h),
        "mlp.linear_fc2.weight": (h, cfg.ffn_hidden_size),
    }
    if cfg.is_moe:
        e, f = cfg.num_experts or 0, cfg.expert_ffn_hidden_size
        per_layer.update({ROUTER: (e, h), EXPERT_FC1: (e, 2 * f, h), EXPERT_FC2: (e, h, f)})
    shapes: dict[str, tuple[int, ...]] = {}
    for key in native_keys(cfg):
        m = _LAYER_RE.match(key)
        if m:
            shapes[key] = per_layer[m[2]]
        elif key == FINAL_NORM:
            shapes[key] = (h,)
        else:
            shapes[key] = (cfg.vocab_size, h)
    return shapes


def shard_shape(shape: tuple[int, ...], rule: Rule, tp: int) -> tuple[int, ...]:
    if rule == "rep":
        return shape
    out = list(shape)
    out[rule_dim(rule, len(shape))] //= tp
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One model chunk of one pipeline stage: ``model`` (or ``model{v}`` with VPP) in ``mp_rank_TT_PPP``."""

    stage: int
    index: int  # virtual chunk v; 0 without VPP
    layers: tuple[int, ...]  # global layer numbers, local index = position in this tuple
    first: bool  # holds the embedding
    last: bool  # holds the final norm and the output layer


def pipeline_chunks(
    num_layers: int, pp: int, num_layer_list: list[int] | None = None, vpp_layers: int | None = None
) -> list[list[Chunk]]:
    """Per stage, its model chunks. Raises LayoutError (``engine.contract.layout``, a ValueError) when the layers
    cannot be divided as asked."""
    layout.check(layout.Shape(num_layers=num_layers), layout.ParallelDims(pp=pp), num_layer_list, vpp_layers)
    if num_layer_list:
        starts = [sum(num_layer_list[:p]) for p in range(pp)]
        return [
            [Chunk(p, 0, tuple(range(starts[p], starts[p] + num_layer_list[p])), p == 0, p == pp - 1)]
            for p in range(pp)
        ]
    if not vpp_layers:
        per = num_layers // pp
        return [[Chunk(p, 0, tuple(range(p * per, (p + 1) * per)), p == 0, p == pp - 1)] for p in range(pp)]
    nv = num_layers // (pp * vpp_layers)
    return [
        [
            Chunk(
                p,
                v,
                tuple(range((v * pp + p) * vpp_layers, (v * pp + p + 1) * vpp_layers)),
                p == 0 and v == 0,
                p == pp - 1 and v == nv - 1,
            )
            for v in range(nv)
        ]
        for p in range(pp)
    ]


def chunk_keys(cfg: ModelConfig, chunk: Chunk, pp: int) -> list[tuple[str, str]]:
    """(local key as stored in the rank file, native key) for every tensor of ``chunk``.

    A tied model with PP > 1 stores a copy of the embedding as ``output_layer.weight`` on the last stage
    (Megatron's ``setup_embeddings_and_output_layer``); its native key is then the embedding's.
    """
    pairs: list[tuple[str, str]] = []
    if chunk.first:
        pairs.append((EMBEDDING, EMBEDDING))
    for local, layer in enumerate(chunk.layers):
        pairs += [(f"decoder.layers.{local}.{s}", f"decoder.layers.{layer}.{s}") for s in layer_rules(cfg, layer)]
    if chunk.last:
        pairs.append((FINAL_NORM, FINAL_NORM))
        if not cfg.tie_word_embeddings:
            pairs.append((OUTPUT, OUTPUT))
        elif pp > 1:
            pairs.append((OUTPUT, EMBEDDING))
    return pairs


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron's ``get_checkpoint_name``: ``mp_rank_TT``, ``_PPP`` when PP > 1, ``_EEE`` when EP > 1."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep == 1 else f"{name}_{ep_rank:03d}"


@dataclasses.dataclass(frozen=True)
class Slot:
    """One tensor of a rank file: ``local`` as stored, cut from native tensor ``native``. Expert tensors hold the
    global experts ``experts`` = [lo, hi): one SequentialMLP expert, or an EP rank's GroupedMLP block (``grouped``)."""

    local: str
    native: str
    experts: tuple[int, int] | None = None
    grouped: bool = False


_EXPERT_NAMES = {EXPERT_FC1: ("linear_fc1.weight", "weight1"), EXPERT_FC2: ("linear_fc2.weight", "weight2")}


def chunk_slots(
    cfg: ModelConfig, chunk: Chunk, pp: int, ep: int = 1, ep_rank: int = 0, grouped: bool = False
) -> list[Slot]:
    """Every tensor of ``chunk`` in EP rank ``ep_rank``'s file, in Megatron's state-dict order: ``chunk_keys``
    with each stacked expert tensor replaced by this rank's local experts (MindSpeed's names)."""
    per = (cfg.num_experts or 0) // ep
    lo = ep_rank * per
    slots: list[Slot] = []
    for local, native in chunk_keys(cfg, chunk, pp):
        parsed = layer_of(local)
        suffix = parsed[1] if parsed else ""
        if suffix not in _EXPERT_NAMES:
            slots.append(Slot(local, native))
            continue
        prefix = local.removesuffix(suffix) + "mlp.experts."
        if grouped:
            slots.append(Slot(prefix + _EXPERT_NAMES[suffix][1], native, (lo, lo + per), True))
        elif suffix == EXPERT_FC1:  # SequentialMLP: expert i's fc1 then fc2, the module order
            for i in range(per):
                for s in (EXPERT_FC1, EXPERT_FC2):
                    name = f"{prefix}local_experts.{i}.{_EXPERT_NAMES[s][0]}"
                    slots.append(Slot(name, native.removesuffix(EXPERT_FC1) + s, (lo + i, lo + i + 1)))
    return slots


def stored_shape(slot: Slot, native_shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Shape of ``slot`` in a rank file of TP ``tp``, from its native tensor's (full, stacked) shape."""
    if slot.experts is None:
        return shard_shape(native_shape, split_rule(slot.native), tp)
    n = slot.experts[1] - slot.experts[0]
    _, rows, cols = shard_shape((n, *native_shape[1:]), split_rule(slot.native), tp)
    if not slot.grouped:
        return (rows, cols)
    return (cols, n * rows) if slot.native.endswith(EXPERT_FC1) else (n * cols, rows)


def cut(slot: Slot, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """``slot``'s stored tensor for TP rank ``rank``, from its native tensor: the whole one, or for experts the
    stacked experts ``slot.experts`` only. May be a view (``.contiguous()`` before writing)."""
    piece = shard(tensor, split_rule(slot.native), tp, rank)
    if slot.experts is None:
        return piece
    if not slot.grouped:
        return piece[0]
    g = piece.transpose(1, 2).contiguous()  # (n, cols, rows): GroupedMLP keeps each expert's matrix transposed
    return g.reshape(g.shape[1], -1) if slot.native.endswith(EXPERT_FC1) else g.reshape(-1, g.shape[2])


def uncut(slot: Slot, stored: torch.Tensor) -> torch.Tensor:
    """Inverse of ``cut`` for an expert slot: the stacked TP piece (n, rows, cols) of experts ``slot.experts``."""
    assert slot.experts is not None
    if not slot.grouped:
        return stored.unsqueeze(0)
    n = slot.experts[1] - slot.experts[0]
    fc1 = slot.native.endswith(EXPERT_FC1)
    stacked = stored.reshape(n, stored.shape[0], -1) if fc1 else stored.reshape(n, -1, stored.shape[1])
    return stacked.transpose(1, 2)


def layer_of(key: str) -> tuple[int, str] | None:
    """(layer index, suffix) of a ``decoder.layers.{i}.suffix`` key, else None."""
    m = _LAYER_RE.match(key)
    return (int(m[1]), m[2]) if m else None
