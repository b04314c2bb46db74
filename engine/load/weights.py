"""What ``load`` holds and how the spec's shape agrees with it, checked before any work (train, eval, serve).

``load`` is told apart by contents: our own training checkpoint (``engine.checkpoint.dcp``: a ``train_state`` dir
or one of its ``iter_*``), an HF directory (config.json + safetensors) or a Megatron mcore checkpoint (tracker file /
``iter_*`` / ``mp_rank_*`` with ``model_optim_rng.pt``), by the rule conversion uses
(``engine.checkpoint.load.detect_format``). The shape comes from the checkpoint; shape flags the user set explicitly
must agree with it (Megatron's ``check_checkpoint_args``), else the run stops with a BadInput naming the flag. Without
``load`` the shape comes from the flags, with Megatron's defaults.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Literal

from engine.checkpoint import dcp
from engine.checkpoint.sources import WeightSource
from engine.contract import rope_scaling
from engine.contract.inspect import SHAPE_FLAGS
from engine.contract.layout import ParallelDims
from engine.contract.model_config import ModelConfig, moe_fields_from_flags
from engine.contract.runfiles import BadInput
from engine.contract.spec import ModelSpec

if TYPE_CHECKING:
    from engine.checkpoint.megatron_read import RankView

Format = Literal["native", "hf", "mcore"]

_SHAPE_FLAGS = SHAPE_FLAGS  # spec flag -> (ModelConfig field, how the flag's value maps onto it)


def detect_format(path: str | os.PathLike[str]) -> Format:
    """CONVERSION's rule (``engine.checkpoint.load``), so every job reads a directory the same way. A finished run's
    ``save`` dir counts as mcore (its final export, newer than any periodic ``train_state`` checkpoint); give
    ``<save>/train_state`` to continue from the training state itself."""
    from engine.checkpoint.load import detect_format as detect

    try:
        return detect(path)
    except BadInput as err:
        raise BadInput(f"load: {err}", "load") from err


@dataclasses.dataclass
class LoadedWeights:
    """What ``load`` holds: its format, model shape and (for HF/mcore) the reader every rank takes its slices from."""

    format: Format
    config: ModelConfig
    source: WeightSource | None  # None for native: loaded collectively through DCP's sharded planner
    meta: dict[str, Any] | None = None  # native only: meta.json


def rank_keys(cfg: ModelConfig, spec: ModelSpec, pp_rank: int) -> list[str]:
    """The native keys PP rank ``pp_rank`` holds under the spec's pipeline layout, in model order (every key when
    the layout is invalid: ``check_parallel_layout`` names that error later)."""
    from engine.model.hf_mapping import layer_rules
    from engine.parallel.pipeline_parallel import stage_layers

    pp = spec.pipeline_model_parallel_size
    try:
        layout = stage_layers(cfg.num_layers, pp, spec.num_layer_list, spec.num_layers_per_virtual_pipeline_stage)
    except ValueError:
        layout, pp, pp_rank = [list(range(cfg.num_layers))], 1, 0
    keys: list[str] = []
    for stage in range(pp_rank, len(layout), pp):
        if stage == 0:
            keys.append("embedding.word_embeddings.weight")
        keys += [f"decoder.layers.{i}.{suffix}" for i in layout[stage] for suffix in layer_rules(cfg, i)]
        if stage == len(layout) - 1:
            keys.append("decoder.final_layernorm.weight")
            if not cfg.tie_word_embeddings or stage != 0:
                keys.append("output_layer.weight")
    return keys


def rank_view(spec: ModelSpec, dims: ParallelDims, rank: int | None = None) -> RankView:
    """Rank ``rank``'s ``megatron_read.RankView`` (default: torchrun's RANK), its TP and PP coordinates those of
    ``dims`` (``ParallelDims.coords``: the mesh's own order)."""
    from engine.checkpoint.megatron_read import RankView

    at = dims.coords(int(os.environ.get("RANK", "0")) if rank is None else rank)
    return RankView(dims.tp, at.tp, dims.pp, at.pp, lambda cfg: rank_keys(cfg, spec, at.pp))


def open_load(path: str, view: RankView | None = None) -> LoadedWeights:
    """Open ``load`` without reading tensor data (headers and pickles only); an mcore checkpoint opens only the
    rank files ``view`` (``rank_view``) needs."""
    fmt = detect_format(path)
    if fmt == "native":
        meta = dcp.read_meta(path)
        return LoadedWeights("native", ModelConfig(**meta["model_config"]), None, meta)
    if fmt == "hf":
        from engine.checkpoint.hf import HFCheckpoint

        ckpt = HFCheckpoint(path)
        return LoadedWeights("hf", ckpt.config, ckpt)
    from engine.checkpoint.megatron_read import MegatronCheckpoint

    try:
        mcore = MegatronCheckpoint(path, view=view)
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise BadInput(f"load: {path} is not a readable Megatron checkpoint ({err})", "load") from err
    return LoadedWeights("mcore", mcore.config, mcore)


def config_from_flags(spec: ModelSpec, tokenizer_vocab: int | None) -> ModelConfig:
    """A from-scratch model's shape from the spec's Megatron flags (``engine.contract.plan.shape.config_from_flags``, the one
    rule the API's planner uses too); a missing flag is a BadInput naming it."""
    from engine.contract.plan.shape import ShapeUnknown
    from engine.contract.plan.shape import config_from_flags as from_flags

    try:
        return from_flags(spec, tokenizer_vocab)
    except ShapeUnknown as err:
        raise BadInput(str(err), err.field) from err


def with_spec_flags(spec: ModelSpec, cfg: ModelConfig) -> ModelConfig:
    """A loaded model's shape with the spec's training knobs: MoE (aux-loss weight, balancing type, capacity) and
    rope scaling."""
    fields = moe_fields_from_flags(spec, cfg)
    return with_rope_flags(spec, cfg.replace(**fields) if fields else cfg)


def with_rope_flags(spec: ModelSpec, cfg: ModelConfig) -> ModelConfig:
    """A loaded model with the spec's rope scaling (YaRN set on a checkpoint without it stretches the model to
    longer samples; each flag set overrides the checkpoint's value)."""
    fields = rope_scaling.from_flags(spec)
    try:
        return cfg.replace(**fields) if fields else cfg
    except ValueError as err:
        field = str(err).split(":", 1)[0]
        raise BadInput(str(err), field if field in type(spec).model_fields else "load") from err


def check_against_checkpoint(spec: ModelSpec, cfg: ModelConfig, source: str) -> None:
    """BadInput for the first explicitly set shape flag that disagrees with the checkpoint's shape."""
    explicit = spec.model_fields_set
    pairs = [(flag, *_SHAPE_FLAGS[flag]) for flag in _SHAPE_FLAGS if flag in explicit]
    if "num_query_groups" in explicit and spec.group_query_attention:
        pairs.append(("num_query_groups", "num_query_groups", int))
    for flag, field, convert in pairs:
        wanted, have = convert(getattr(spec, flag)), getattr(cfg, field)
        same = abs(wanted - have) <= 1e-9 * max(abs(have), 1) if isinstance(have, float) else wanted == have
        if not same:
            raise BadInput(
                f"{flag}: the spec says {getattr(spec, flag)!r} but the checkpoint {source} has {field}={have!r}; "
                "drop the flag to take the checkpoint's value, or load a matching checkpoint",
                flag,
            )


def check_model_kind(spec: ModelSpec) -> None:
    """Only Qwen3 (RMSNorm, RoPE, SwiGLU) is built here: refuse explicit flags asking for something else."""
    explicit = spec.model_fields_set
    if "normalization" in explicit and spec.normalization != "RMSNorm":
        raise BadInput(f"normalization: {spec.normalization} is not supported (Qwen3 uses RMSNorm)", "normalization")
    if "position_embedding_type" in explicit and spec.position_embedding_type != "rope":
        raise BadInput(
            f"position_embedding_type: {spec.position_embedding_type} is not supported (rope only)",
            "position_embedding_type",
        )
    if (
        "num_query_groups" in explicit
        and not spec.group_query_attention
        and spec.num_query_groups != spec.num_attention_heads
    ):
        raise BadInput(
            "num_query_groups: set group_query_attention too (Megatron ignores the groups without it)",
            "num_query_groups",
        )


def refield(err: BadInput, field: str) -> BadInput:
    """The checkpoint readers speak of ``load_dir`` (the convert job's flag); name this job's flag instead."""
    return BadInput(str(err) if str(err).startswith(field) else f"{field}: {err}", field=field)


def given(path: str | None, field: str) -> str:
    """A path this loader needs (an eval through a deployment has no ``load``; it never reaches here)."""
    if path is None:
        raise BadInput(f"{field}: required to load the model", field=field)
    return path


def open_source(path: str, field: str = "load") -> WeightSource:
    """The reader of an HF directory, a Megatron checkpoint or one of our training checkpoints (no tensor read)."""
    from engine.checkpoint.load import open_checkpoint

    try:
        return open_checkpoint(path)[1]
    except BadInput as err:
        raise refield(err, field) from err
    except FileNotFoundError as err:
        raise BadInput(f"{field}: {err}", field=field) from err
