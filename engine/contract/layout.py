"""The one parallel-layout rule: which TP/PP/EP layouts a model shape admits, and each rank's coordinates.

Admission (``core.admission``), spec validation (``engine.contract.spec``), the TP and EP plans, the checkpoint converters
and the eval mesh all call ``check``; a refusal is a ``LayoutError`` naming the spec field to change, so the
service and the engine refuse the same layout with the same words.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, NamedTuple

from engine.contract.model_config import ModelConfig

_WORLD = "resources.nnodes × resources.nproc_per_node"

CpAlgo = Literal["ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo"]


class LayoutError(ValueError):
    """A layout the model or the world cannot be split into; ``field`` is the spec field to change."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field
        self.why = why


class Coords(NamedTuple):
    dp: int
    pp: int
    tp: int
    ep: int
    cp: int


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension. World = dp × cp × pp × tp; EP is carved out of DP (Megatron's
    expert-data-parallel = DP / EP). CP (context parallel) splits each sequence; its ranks share their data."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    cp_algo: CpAlgo = "ulysses_cp_algo"
    ulysses_degree_in_cp: int | None = None  # hybrid_cp_algo only: the Ulysses ranks inside each ring member
    kv_head_repeat: bool = True  # MindSpeed-LLM's kv_head_repeat_before_uly_alltoall: Ulysses may repeat KV heads

    def __post_init__(self) -> None:
        if min(self.dp, self.pp, self.tp, self.ep, self.cp) < 1:
            raise ValueError(f"parallel sizes must be >= 1: {self}")
        if self.cp > 1 and self.cp % self.ulysses_degree:
            raise LayoutError(
                "ulysses_degree_in_cp", f"{self.ulysses_degree} does not divide context_parallel_size {self.cp}"
            )
        if self.dp % self.ep:
            raise LayoutError(
                "expert_model_parallel_size", f"EP {self.ep} must divide the data-parallel size {self.dp}"
            )

    @property
    def ulysses_degree(self) -> int:
        """Ranks of a sequence that swap tokens for heads (all of CP for Ulysses, none for the ring; 1 without CP,
        where a hybrid spec's ``ulysses_degree_in_cp`` has nothing to split)."""
        if self.cp_algo == "megatron_cp_algo" or self.cp == 1:
            return 1
        if self.cp_algo == "hybrid_cp_algo":
            return self.ulysses_degree_in_cp or 1
        return self.cp

    @property
    def ring_degree(self) -> int:
        """Ranks of a sequence that pass K/V blocks round a ring."""
        return self.cp // self.ulysses_degree

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @classmethod
    def from_world(
        cls,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        cp: int = 1,
        cp_algo: CpAlgo = "ulysses_cp_algo",
        ulysses_degree_in_cp: int | None = None,
        kv_head_repeat: bool = True,
    ) -> ParallelDims:
        """The dims of ``world_size`` ranks; LayoutError when TP × PP (× CP) or EP do not fit."""
        if world_size % (tp * pp * cp):
            field, cp_part = (
                ("context_parallel_size", f" × CP ({cp})") if cp > 1 else ("tensor_model_parallel_size", "")
            )
            raise LayoutError(
                field, f"TP ({tp}) × PP ({pp}){cp_part} must divide the world size ({world_size} = {_WORLD})"
            )
        dp = world_size // (tp * pp * cp)
        if dp % ep:
            raise LayoutError(
                "expert_model_parallel_size",
                f"EP {ep} must divide the data-parallel size {dp} (world size / (TP {tp} × PP {pp}{' × CP ' + str(cp) if cp > 1 else ''}))",
            )
        return cls(dp, pp, tp, ep, cp, cp_algo, ulysses_degree_in_cp, kv_head_repeat)

    def coords(self, rank: int) -> Coords:
        """Rank → coordinates, row-major over (dp, cp, pp, tp) as ``engine.parallel.mesh`` lays the mesh out:
        TP varies fastest; the EP rank is the DP rank modulo EP (consecutive DP ranks share an expert group)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        rest, tp = divmod(rank, self.tp)
        rest, pp = divmod(rest, self.pp)
        dp, cp = divmod(rest, self.cp)
        return Coords(dp=dp, pp=pp, tp=tp, ep=dp % self.ep, cp=cp)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the layout rule reads of a model; None is "not known yet" (a spec without ``load`` or flags), and
    its rule is then skipped. ``num_experts`` 0 is a known dense model."""

    num_layers: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None  # None also when every layer is MoE (no dense MLP to shard)
    moe_ffn_hidden_size: int | None = None
    vocab_size: int | None = None  # padded: rows of the embedding and output matrices
    num_experts: int | None = None

    @classmethod
    def of(cls, cfg: ModelConfig) -> Shape:
        dense_mlp = len(cfg.moe_layers) < cfg.num_layers
        return cls(
            num_layers=cfg.num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_query_groups,
            ffn_hidden_size=cfg.ffn_hidden_size if dense_mlp else None,
            moe_ffn_hidden_size=cfg.expert_ffn_hidden_size if cfg.is_moe else None,
            vocab_size=cfg.vocab_size,
            num_experts=cfg.num_experts or 0,
        )


def check(
    model: ModelConfig | Shape,
    dims: ParallelDims,
    num_layer_list: list[int] | None = None,
    vpp_layers: int | None = None,
) -> None:
    """Raise LayoutError for the first rule ``dims`` breaks on ``model``: TP over heads, KV groups, FFN sizes and
    vocabulary; PP (and virtual PP) over layers; EP over experts. World divisibility is ``ParallelDims.from_world``'s.
    """
    shape = Shape.of(model) if isinstance(model, ModelConfig) else model
    _check_tp(shape, dims.tp)
    _check_cp(shape, dims)
    _check_pp(shape, dims.pp, num_layer_list, vpp_layers)
    _check_ep(shape, dims.ep)


def _check_tp(shape: Shape, tp: int) -> None:
    sizes = [
        (shape.num_attention_heads, "heads (num_attention_heads)"),
        (shape.num_query_groups, "KV heads (num_query_groups); each rank must hold whole groups"),
        (shape.ffn_hidden_size, "FFN width (ffn_hidden_size)"),
        (shape.moe_ffn_hidden_size, "expert FFN width (moe_ffn_hidden_size)"),
        (shape.vocab_size, "vocabulary rows (padded_vocab_size)"),
    ]
    for value, what in sizes:
        if value is not None and value % tp:
            raise LayoutError("tensor_model_parallel_size", f"TP {tp} does not divide the model's {value} {what}")


def _check_cp(shape: Shape, dims: ParallelDims) -> None:
    """Ulysses context parallelism swaps the sequence split for a head split around attention: each of the TP ×
    Ulysses ranks of a sequence must get whole heads, and whole KV groups unless KV heads may be repeated (``kv_repeats``,
    MindSpeed-LLM's ``kv_head_repeat_before_uly_alltoall``, on by default); the ring passes whole K/V blocks and needs
    nothing of the heads. Checked here, where the shape is known whether it comes from flags, from a checkpoint at
    submission or from the loaded model."""
    if dims.cp == 1:
        return
    tp, ulysses = dims.tp, dims.ulysses_degree
    field, what_u = (
        ("ulysses_degree_in_cp", "Ulysses degree")
        if dims.cp_algo == "hybrid_cp_algo"
        else ("context_parallel_size", "CP")
    )
    checked = [(shape.num_attention_heads, "heads")]
    if not dims.kv_head_repeat:  # else Ulysses repeats KV heads until they split (``kv_repeats``): heads suffice
        checked.append((shape.num_query_groups, "KV groups"))
    for value, what in checked:
        if ulysses > 1 and value is not None and value % (tp * ulysses):
            hint = " (kv_head_repeat_before_uly_alltoall would repeat them)" if what == "KV groups" else ""
            raise LayoutError(
                field, f"TP {tp} × {what_u} {ulysses} does not divide the model's {value} {what} (Ulysses){hint}"
            )


def kv_repeats(kv_heads: int, ulysses: int) -> int:
    """How many times Ulysses repeats each of a rank's ``kv_heads`` (after TP) so that they split evenly over
    ``ulysses`` ranks: the least r with ``kv_heads × r`` a multiple of the degree (1 when they divide). MindSpeed-LLM
    repeats every KV head to its whole query group instead; r divides the group size whenever the query heads split,
    so the repeated heads keep each query head's own K/V."""
    return ulysses // math.gcd(kv_heads, ulysses)


def _check_pp(shape: Shape, pp: int, num_layer_list: list[int] | None, vpp_layers: int | None) -> None:
    layers = shape.num_layers
    if num_layer_list is not None:
        if len(num_layer_list) != pp:
            raise LayoutError("num_layer_list", f"has {len(num_layer_list)} stages but PP is {pp}")
        if min(num_layer_list, default=1) < 1:
            raise LayoutError("num_layer_list", f"{list(num_layer_list)}: every stage needs at least one layer")
        if layers is not None and sum(num_layer_list) != layers:
            raise LayoutError("num_layer_list", f"sums to {sum(num_layer_list)}, not the model's {layers} layers")
        if vpp_layers:
            raise LayoutError("num_layer_list", "cannot be combined with num_layers_per_virtual_pipeline_stage")
        return
    if layers is None:
        return
    if layers % pp:
        raise LayoutError(
            "pipeline_model_parallel_size", f"PP {pp} does not divide the model's {layers} layers; give num_layer_list"
        )
    if vpp_layers and layers % (pp * vpp_layers):
        raise LayoutError(
            "num_layers_per_virtual_pipeline_stage",
            f"PP {pp} × {vpp_layers} layers per virtual stage does not divide the model's {layers} layers",
        )


def _check_ep(shape: Shape, ep: int) -> None:
    if ep == 1 or shape.num_experts is None:
        return
    if shape.num_experts == 0:
        raise LayoutError("expert_model_parallel_size", f"EP {ep} needs an MoE model (num_experts); the model is dense")
    if shape.num_experts % ep:
        raise LayoutError(
            "expert_model_parallel_size",
            f"EP {ep} does not divide the model's {shape.num_experts} experts (num_experts)",
        )
