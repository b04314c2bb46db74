"""Job specs: one pydantic schema shared by the API, the worker and the engine.

Field names are MindSpeed-LLM's command-line flags in snake_case (``--tensor-model-parallel-size`` ->
``tensor_model_parallel_size``) with MindSpeed's meaning and default, flat at the top level of a spec, so a user who
knows MindSpeed knows this API and ``python -m engine <kind>`` maps flag for flag (see ``engine.contract.flags``).
The only nested objects are ``resources`` and ``metadata`` (and a pipeline's ``steps``).

Path fields are checked against the caller's data areas when the spec is validated with
``context={"data_roots": [...], "read_roots": [...]}`` (the API does this with the team's areas, ``core.paths``):
outputs only inside ``data_roots``, inputs also inside ``read_roots``. The engine, run standalone, trusts its user;
run by a worker it re-checks every path right before opening it (``engine.contract.guard``).
This module must not import torch.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from engine.contract import layout, net_rules
from engine.contract.constants import REFERENCE_FREE_LOSSES
from engine.contract.data_formats import HANDLERS, PAIRWISE_HANDLERS, TEMPLATES, check_map_keys, handler_format
from engine.contract.lora_targets import resolve_targets
from engine.contract.nofollow import links_below
from engine.contract.retention import metric_name

# ---------------------------------------------------------------- field types


def _resolve_in_roots(value: str | None, info: ValidationInfo, *, output: bool = False) -> str | None:
    """Resolve ``value`` and refuse it unless it stays inside one of the context's data roots (the caller's areas;
    an input may also be inside ``read_roots``, the shared read-only areas). Relative paths start at the first root."""
    if value is None or not info.context or info.context.get("data_roots") is None:
        return value
    roots = [Path(r).resolve() for r in info.context["data_roots"]]
    readable = [] if output else [Path(r).resolve() for r in info.context.get("read_roots") or ()]
    if not roots:
        raise ValueError("no data roots are configured, so no path is allowed")
    raw = Path(value)
    if ".." in raw.parts:
        raise ValueError(f"path {value!r} must not contain '..'")
    candidate = raw if raw.is_absolute() else roots[0] / raw
    resolved = candidate.resolve()  # follows symlinks, so a link pointing outside is caught below
    if not within(resolved, [*roots, *readable]):
        where = ", ".join(map(str, roots)) + (f"; or, to read, {', '.join(map(str, readable))}" if readable else "")
        what = "an output" if output else "a path"
        raise ValueError(f"{what} {value!r} resolves outside your data area ({where})")
    if not output and resolved.is_dir():
        _refuse_links_out(value, resolved, [*roots, *readable])
    return str(resolved)


LINK_SCAN_ENTRIES = 100_000  # a submission looks at this many entries of an input folder; the engine at every one


def _refuse_links_out(value: str, folder: Path, areas: list[Path]) -> None:
    """An input folder (a checkpoint, a tokenizer) holding a link that leads out of the caller's areas is refused:
    the engine would read another team's files through it (``engine.contract.guard`` checks every entry again at run
    time, and reads adapters without following links)."""
    for link in links_below(folder, LINK_SCAN_ENTRIES):
        if not within(link.resolve(), areas):
            inside = link.relative_to(folder)
            raise ValueError(f"{value!r} holds {str(inside)!r}, a symbolic link leading outside your data area")


def within(path: Path, roots: list[Path]) -> bool:
    """Whether ``path`` (resolved) is one of ``roots`` or below one."""
    return any(path == r or r in path.parents for r in roots)


DataPath = Annotated[str, AfterValidator(_resolve_in_roots)]
"""A filesystem path a job reads; must resolve inside the caller's areas (or a shared read-only one) when submitted
over the API."""


def _resolve_output(value: str | None, info: ValidationInfo) -> str | None:
    return _resolve_in_roots(value, info, output=True)


def _output_below_root(value: str | None, info: ValidationInfo) -> str | None:
    """An output must name something inside a root, not the root: a prefix equal to the root ("", ".") would put
    ``<root>_text_document.bin`` beside it, outside every root."""
    if value is None or not info.context or info.context.get("data_roots") is None:
        return value
    if any(Path(value) == Path(r).resolve() for r in info.context["data_roots"]):
        raise ValueError(f"path {value!r} is your data area itself; name a file or directory inside it")
    return value


OutputPath = Annotated[str, AfterValidator(_resolve_output), AfterValidator(_output_below_root)]
"""A path a job writes: strictly below one of the caller's own areas (never a shared read-only one)."""


def _split_list(value: Any) -> Any:
    """Accept MindSpeed's comma/space separated strings ("4,4" or "a b") for list fields."""
    if isinstance(value, str):
        return [v for v in value.replace(",", " ").split() if v]
    return value


def _json_object(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"not valid JSON: {err.msg} at character {err.pos}") from err
    return value


def _tristate(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value).lower()


def _resolve_list_in_roots(values: list[str], info: ValidationInfo) -> list[str]:
    """Each path of a list inside the data roots; numbers pass (Megatron's blend "0.3 prefix1 0.7 prefix2")."""
    return [value if _is_number(value) else str(_resolve_in_roots(value, info)) for value in values]


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _layer_freq(value: Any) -> Any:
    """Megatron's ``--moe-layer-freq``: an int, or a 0/1 per layer as "[1,0,1]" / "1,0,1" / a list. Megatron's
    Python-expression form ("([1]*3+[0])*2") is refused: user input is never evaluated."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        parts = [p for p in text.replace(",", " ").split() if p]
        if not all(p.lstrip("-").isdigit() for p in parts) or not parts:
            raise ValueError(f"must be an int or a list of 0/1 per layer like [1,0,1], got {value!r}")
        return int(parts[0]) if len(parts) == 1 and not value.strip().startswith("[") else [int(p) for p in parts]
    return value


def _check_layer_freq(value: int | list[int]) -> int | list[int]:
    if isinstance(value, int) and value < 1:
        raise ValueError(f"must be >= 1 (every k-th layer is MoE), got {value}")
    if isinstance(value, list) and (not value or any(v not in (0, 1) for v in value)):
        raise ValueError(f"a per-layer pattern holds only 0 (dense) and 1 (MoE), got {value}")
    return value


IntList = Annotated[list[int], BeforeValidator(_split_list)]
LayerFreq = Annotated[int | list[int], BeforeValidator(_layer_freq), AfterValidator(_check_layer_freq)]
StrList = Annotated[list[str], BeforeValidator(_split_list)]


def _check_lora_targets(value: list[str]) -> list[str]:
    resolve_targets(value)  # unknown names and part of a fused module are refused; the names are kept as given
    return value


LoraTargets = Annotated[list[str], BeforeValidator(_split_list), AfterValidator(_check_lora_targets)]
DataPathList = Annotated[list[str], BeforeValidator(_split_list), AfterValidator(_resolve_list_in_roots)]
"""Paths (optionally with blend weights) that must all resolve inside the data roots when submitted over the API."""
JsonObject = Annotated[dict[str, Any], BeforeValidator(_json_object)]
TriState = Annotated[Literal["true", "false", "none"], BeforeValidator(_tristate)]
DeviceType = Literal["cpu", "cuda", "npu"]
BestBy = Annotated[Literal["lm_loss", "val_lm_loss"], BeforeValidator(metric_name)]
"""A loss metric a checkpoint is ranked by (lower is better); MindSpeed's spellings ("lm loss", "val_loss") accepted."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Resources(_Strict):
    """What the job asks of the cluster: ``nnodes × nproc_per_node`` devices of one type."""

    device_type: DeviceType = Field(
        "cpu", description="Accelerator type the job runs on: cpu (gloo), cuda (nccl) or npu (hccl, Ascend)."
    )
    nnodes: int = Field(1, ge=1, le=1024, description="Hosts the job spans (torchrun --nnodes); one node per host.")
    nproc_per_node: int = Field(
        1, ge=1, le=64, description="Devices (processes) per host (torchrun --nproc-per-node); CPU: process slots."
    )
    pool: str | None = Field(
        None,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="A Slurm pool (the service's LLMJOBS_SLURM_POOLS) to run on instead of the pinned hosts; "
        "None = the pinned hosts.",
    )

    @model_serializer(mode="wrap")
    def _no_pool_for_pinned_hosts(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A pinned hosts' job stores no ``pool``: its resources read (and group in the scheduler) as before pools."""
        data: dict[str, Any] = handler(self)
        if data.get("pool") is None:
            data.pop("pool", None)
        return data

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class JobBase(_Strict):
    """Fields every job has, whatever its kind."""

    name: str | None = Field(None, max_length=200, description="Free-form job name, filterable in GET /v1/jobs.")
    resources: Resources = Field(
        default_factory=Resources,
        description="Devices the job asks for: resources.nnodes × resources.nproc_per_node of resources.device_type.",
    )
    metadata: dict[str, str] = Field(default_factory=dict, description="String labels, filterable in GET /v1/jobs.")
    priority: int = Field(
        0,
        ge=-100,
        le=100,
        description="Higher runs first; within a priority teams take turns (the team holding the fewest devices "
        "goes next), each team's jobs in submission order. At most the team's ceiling (team_priority_ceiling).",
    )
    max_restarts: int | None = Field(
        None, ge=0, le=100, description="Retries after a retryable failure; None = server default."
    )
    start_deadline_s: float | None = Field(
        None, gt=0, description="Fail the job if it has not started within this many seconds."
    )
    run_deadline_s: float | None = Field(
        None, gt=0, description="Cancel the job if it runs longer than this many seconds."
    )


# ---------------------------------------------------------------- shared flag groups


class ModelArgs(_Strict):
    """Model-shape flags (Megatron/MindSpeed ``GPT_ARGS``). Unset shape fields come from the checkpoint's config.json."""

    use_mcore_models: bool = Field(
        False,
        description="--use-mcore-models: Megatron-Core model layout (the layout this engine always uses; accepted for script parity).",
    )
    num_layers: int | None = Field(
        None, ge=1, description="--num-layers: transformer layers. Default: from the checkpoint's config.json."
    )
    hidden_size: int | None = Field(
        None, ge=1, description="--hidden-size: model width. Default: from the checkpoint's config.json."
    )
    ffn_hidden_size: int | None = Field(
        None, ge=1, description="--ffn-hidden-size: MLP inner width. Default: from the checkpoint's config.json."
    )
    num_attention_heads: int | None = Field(
        None, ge=1, description="--num-attention-heads: query heads. Default: from the checkpoint's config.json."
    )
    group_query_attention: bool = Field(
        False, description="--group-query-attention: KV heads shared by groups of query heads (Qwen3: on)."
    )
    num_query_groups: int | None = Field(None, ge=1, description="KV heads; Megatron's default is 1 when GQA is on.")
    kv_channels: int | None = Field(None, ge=1, description="Head dim; default hidden_size / num_attention_heads.")
    qk_layernorm: bool = Field(False, description="--qk-layernorm: RMSNorm on per-head queries and keys (Qwen3: on).")
    max_position_embeddings: int | None = Field(
        None,
        ge=1,
        description="--max-position-embeddings: longest position the RoPE tables cover, in tokens. Default: from the checkpoint.",
    )
    seq_length: int | None = Field(None, ge=1, description="--seq-length: tokens per training/eval sample row.")
    padded_vocab_size: int | None = Field(
        None,
        ge=1,
        description="--padded-vocab-size: embedding rows. Default: from the checkpoint (else the tokenizer's vocab padded).",
    )
    make_vocab_size_divisible_by: int = Field(
        128,
        ge=1,
        description="--make-vocab-size-divisible-by: pad the vocab to a multiple of this (× TP) when it is derived.",
    )
    rotary_base: float = Field(10000.0, gt=0, description="--rotary-base: RoPE theta (Qwen3: 1000000).")
    rope_scaling_type: Literal["yarn"] | None = Field(
        None,
        description="--rope-scaling-type: yarn stretches RoPE past the pre-trained length (Qwen3: 32,768 × 4 = "
        "131,072 positions). Default: the checkpoint's config (set here, it applies to a checkpoint without it).",
    )
    rope_scaling_factor: float | None = Field(
        None, ge=1, description="--rope-scaling-factor: how many times the original length YaRN reaches (Qwen3: 4)."
    )
    rope_scaling_original_max_position_embeddings: int | None = Field(
        None,
        ge=1,
        description="--rope-scaling-original-max-position-embeddings: the length the model was pre-trained at "
        "(Qwen3: 32768); required with rope_scaling_type.",
    )
    rope_scaling_beta_fast: float | None = Field(
        None, gt=0, description="--rope-scaling-beta-fast: YaRN's high-frequency boundary in rotations (default 32)."
    )
    rope_scaling_beta_slow: float | None = Field(
        None, gt=0, description="--rope-scaling-beta-slow: YaRN's low-frequency boundary in rotations (default 1)."
    )
    rope_scaling_mscale: float | None = Field(
        None, gt=0, description="--rope-scaling-mscale: numerator of YaRN's attention scale (with mscale_all_dim)."
    )
    rope_scaling_mscale_all_dim: float | None = Field(
        None, gt=0, description="--rope-scaling-mscale-all-dim: denominator of YaRN's attention scale."
    )
    norm_epsilon: float = Field(1e-5, gt=0, description="--norm-epsilon: epsilon of RMSNorm/LayerNorm (Qwen3: 1e-6).")
    untie_embeddings_and_output_weights: bool = Field(
        False, description="--untie-embeddings-and-output-weights: separate output projection (Qwen3 ≥ 4B: on)."
    )
    swiglu: bool = Field(False, description="--swiglu: SwiGLU MLP (gate and up fused in linear_fc1; Qwen3: on).")
    disable_bias_linear: bool = Field(False, description="--disable-bias-linear: no bias in linear layers (Qwen3: on).")
    normalization: Literal["RMSNorm", "LayerNorm"] = Field(
        "LayerNorm", description="--normalization: RMSNorm (Qwen3) or LayerNorm (Megatron's default)."
    )
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = Field(
        "learned_absolute",
        description="--position-embedding-type: rope (Qwen3), learned_absolute (Megatron's default) or none.",
    )
    use_rotary_position_embeddings: bool = Field(
        False, description="--use-rotary-position-embeddings: older alias of position_embedding_type=rope."
    )
    hidden_dropout: float = Field(
        0.1,
        ge=0,
        le=1,
        description="--hidden-dropout: accepted for script parity; the Qwen3 model here has no dropout (a value > 0 is ignored with a warning).",
    )
    attention_dropout: float = Field(
        0.1,
        ge=0,
        le=1,
        description="--attention-dropout: accepted for script parity; the Qwen3 model here has no dropout (a value > 0 is ignored with a warning).",
    )
    init_method_std: float = Field(
        0.02, gt=0, description="--init-method-std: std of the normal init of new weights (pretraining from scratch)."
    )
    attention_softmax_in_fp32: bool = Field(
        False,
        description="--attention-softmax-in-fp32: attention softmax in fp32 under bf16/fp16 (accepted for script parity).",
    )
    norm_topk_prob: bool = Field(
        False, description="MoE: renormalise the top-k routing weights to sum to 1 (Qwen3-MoE: on)."
    )
    num_experts: int | None = Field(
        None, ge=1, description="MoE: routed experts per MoE layer; unset = a dense model (or the checkpoint's)."
    )
    moe_router_topk: int = Field(2, ge=1, description="MoE: experts each token is routed to (Qwen3-MoE: 8).")
    moe_ffn_hidden_size: int | None = Field(
        None, ge=1, description="MoE: FFN width of one expert; default ffn_hidden_size."
    )
    moe_intermediate_size: int | None = Field(None, ge=1, description="MindSpeed's name for moe_ffn_hidden_size.")
    moe_layer_freq: LayerFreq = Field(
        1,
        description=(
            "MoE: an int k (layers with index % k == 0 are MoE) or one 0/1 per layer like [1,0,1] (0 = dense MLP)."
        ),
    )
    moe_grouped_gemm: bool = Field(
        False,
        description=(
            "Local experts always run as grouped matmuls (torch._grouped_mm where the device has it); this flag picks "
            "the final mcore export's expert layout as MindSpeed saves it: GroupedMLP mlp.experts.weight1/weight2 "
            "(set) or SequentialMLP mlp.experts.local_experts.{i}.* (unset)."
        ),
    )
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = Field(
        "allgather",
        description=(
            "MoE token dispatch across expert-parallel ranks (no effect while expert_model_parallel_size is 1): both "
            "run the same all-to-all exchange here (allgather is mapped onto it; the results are the same)."
        ),
    )
    moe_router_load_balancing_type: Literal["aux_loss", "none"] = Field(
        "aux_loss",
        description=(
            "aux_loss: Megatron's switch load-balancing loss weighted by moe_aux_loss_coeff; none: no balancing loss."
        ),
    )
    moe_aux_loss_coeff: float | None = Field(
        None,
        ge=0,
        description=(
            "Weight of the load-balancing loss per MoE layer; unset = the checkpoint's router_aux_loss_coef "
            "(0 without one)."
        ),
    )
    moe_expert_capacity_factor: float | None = Field(
        None,
        gt=0,
        description=(
            "MoE: unset = dropless; else each expert takes at most ceil(tokens × topk / experts × factor) tokens per "
            "micro-batch and drops the lowest-probability rest (Megatron's 'probs' policy); tokens counted per rank before "
            "expert-parallel dispatch, as Megatron's router does."
        ),
    )
    tokenizer_type: str | None = Field(
        None,
        description="--tokenizer-type: PretrainedFromHF (a Hugging Face tokenizer directory) is the one supported.",
    )
    tokenizer_name_or_path: DataPath | None = Field(
        None, description="--tokenizer-name-or-path: local Hugging Face tokenizer directory (inside the data roots)."
    )
    tokenizer_not_use_fast: bool = Field(
        False, description="--tokenizer-not-use-fast: use the slow Python tokenizer instead of tokenizers' Rust one."
    )
    bf16: bool = Field(
        False, description="--bf16: bfloat16 parameters and compute, fp32 master weights in the optimizer."
    )
    fp16: bool = Field(False, description="--fp16: float16 compute with dynamic loss scaling (see initial_loss_scale).")
    seed: int = Field(1234, description="--seed: random seed for initialisation, dropout and data shuffling.")

    @model_validator(mode="after")
    def _check_shape(self) -> ModelArgs:
        if self.bf16 and self.fp16:
            raise ValueError("bf16: choose at most one of bf16 and fp16")
        self._check_moe()
        self._check_rope_scaling()
        return self

    def _check_rope_scaling(self) -> None:
        others = [f for f in type(self).model_fields if f.startswith("rope_scaling_") and f != "rope_scaling_type"]
        if self.rope_scaling_type is None:
            given = [f for f in others if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{given[0]}: set only with rope_scaling_type (yarn)")
            return
        for needed in ("rope_scaling_factor", "rope_scaling_original_max_position_embeddings"):
            if getattr(self, needed) is None:
                raise ValueError(f"{needed}: required with rope_scaling_type {self.rope_scaling_type}")

    def _check_moe(self) -> None:
        ffn, alias = self.moe_ffn_hidden_size, self.moe_intermediate_size
        if ffn is not None and alias is not None and ffn != alias:
            raise ValueError(f"moe_intermediate_size: {alias} disagrees with moe_ffn_hidden_size {ffn}; give one")
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ValueError(f"moe_router_topk: {self.moe_router_topk} is more than num_experts ({self.num_experts})")
        freq = self.moe_layer_freq
        if isinstance(freq, list) and self.num_layers is not None and len(freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq: the pattern has {len(freq)} entries but num_layers is {self.num_layers}")


class ParallelArgs(_Strict):
    """Parallel layout flags; DP = world size / (TP × PP)."""

    tensor_model_parallel_size: int = Field(
        1, ge=1, description="--tensor-model-parallel-size: TP degree, devices that split each layer's matrices."
    )
    pipeline_model_parallel_size: int = Field(
        1, ge=1, description="--pipeline-model-parallel-size: PP degree, stages the layers are split into."
    )
    expert_model_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "--expert-model-parallel-size: MoE, ranks each MoE layer's experts are split over (num_experts / EP per "
            "rank), carved out of data parallel: EP must divide num_experts and DP = world / (TP × PP). Composes with TP "
            "(experts cut over EP, then per expert over TP), with PP (each stage's DP ranks form its EP groups) and "
            "with both."
        ),
    )
    sequence_parallel: bool = Field(
        False, description="--sequence-parallel: with TP > 1, shard norms and dropout activations along the sequence."
    )
    num_layer_list: IntList | None = Field(None, description="Layers per pipeline stage, e.g. '10,8,8,10'.")
    num_layers_per_virtual_pipeline_stage: int | None = Field(
        None, ge=1, description="--num-layers-per-virtual-pipeline-stage: layers per virtual stage (interleaved 1F1B)."
    )
    use_distributed_optimizer: bool = Field(
        False,
        description="--use-distributed-optimizer: on, parameters are resharded after forward (ZeRO-3, least memory); off, they stay gathered until backward (ZeRO-2). Optimizer state is sharded over data-parallel ranks either way.",
    )
    micro_batch_size: int = Field(
        1, ge=1, description="--micro-batch-size: samples per device per forward/backward pass."
    )
    global_batch_size: int | None = Field(None, ge=1, description="Default micro_batch_size × DP.")

    @model_validator(mode="after")
    def _check_layout(self) -> ParallelArgs:
        """The one layout rule (``engine.contract.layout``) over what the flags tell of the model's shape."""
        dims = self.parallel_dims
        layout.check(self._flag_shape(), dims, self.num_layer_list, self.num_layers_per_virtual_pipeline_stage)
        if self.global_batch_size is not None and self.global_batch_size % (self.micro_batch_size * dims.dp):
            raise ValueError(
                f"global_batch_size: {self.global_batch_size} is not divisible by micro_batch_size × DP "
                f"({self.micro_batch_size} × {dims.dp})"
            )
        return self

    def _flag_shape(self) -> layout.Shape:
        """The shape the flags give; a rule whose quantity the flags leave to the checkpoint is skipped here and
        applied by admission once the checkpoint is read."""
        heads = getattr(self, "num_attention_heads", None)
        experts = getattr(self, "num_experts", None)
        from_scratch = getattr(self, "load", None) is None and getattr(self, "hidden_size", None) is not None
        return layout.Shape(
            num_layers=getattr(self, "num_layers", None),
            num_attention_heads=heads,
            num_query_groups=getattr(self, "num_query_groups", None)
            if getattr(self, "group_query_attention", False)
            else heads,
            ffn_hidden_size=getattr(self, "ffn_hidden_size", None) if experts is None else None,
            moe_ffn_hidden_size=getattr(self, "moe_ffn_hidden_size", None)
            or getattr(self, "moe_intermediate_size", None),
            vocab_size=getattr(self, "padded_vocab_size", None),
            num_experts=experts if experts is not None else (0 if from_scratch else None),
        )

    @property
    def parallel_dims(self) -> layout.ParallelDims:
        """World → DP/TP/PP/EP sizes (LayoutError when TP × PP or EP do not fit the world)."""
        world = self.resources.world_size if isinstance(self, JobBase) else 1
        return layout.ParallelDims.from_world(
            world,
            tp=self.tensor_model_parallel_size,
            pp=self.pipeline_model_parallel_size,
            ep=self.expert_model_parallel_size,
            cp=getattr(self, "context_parallel_size", 1),  # a train spec's own fields
            cp_algo=getattr(self, "context_parallel_algo", "ulysses_cp_algo"),
            ulysses_degree_in_cp=getattr(self, "ulysses_degree_in_cp", None),
            kv_head_repeat=getattr(self, "kv_head_repeat_before_uly_alltoall", True),
        )

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_dims.dp


# ---------------------------------------------------------------- job kinds


class PreprocessSpec(JobBase):
    """``preprocess_data.py``: raw instruction/pretraining data -> Megatron indexed datasets (``engine.preprocess``)."""

    kind: Literal["preprocess"] = Field("preprocess", description='Job kind "preprocess" (the discriminator).')
    input: DataPath = Field(
        ..., description="A file or a directory of .jsonl/.json/.parquet/.csv/.txt/.arrow files (one format)."
    )
    tokenizer_name_or_path: DataPath = Field(..., description="Local directory of a Hugging Face tokenizer.")
    output_prefix: OutputPath = Field(
        ...,
        description="Instruction data: <prefix>_packed_{input_ids,attention_mask,labels}_document; text: <prefix>_<key>_document.",
    )
    tokenizer_type: Literal["PretrainedFromHF"] = Field(
        "PretrainedFromHF", description="--tokenizer-type: PretrainedFromHF, the one supported."
    )
    tokenizer_not_use_fast: bool = Field(
        False, description="--tokenizer-not-use-fast: use the slow Python tokenizer instead of tokenizers' Rust one."
    )
    handler_name: str = Field(
        "",
        description="SharegptStyleInstructionHandler (ShareGPT/OpenAI messages), AlpacaStyleInstructionHandler, "
        "GeneralInstructionHandler (Alpaca); SharegptStylePairwiseHandler / AlpacaStylePairwiseHandler (preference "
        "pairs: <prefix>_packed_{chosen,rejected}_{input_ids,labels}_document); empty or GeneralPretrainHandler = "
        "pretraining text.",
    )
    prompt_type: str | None = Field(
        None,
        description="Chat template for instruction data: qwen3, qwen (MindSpeed's older qwen: default system prompt, no thinking rules) or hf (the tokenizer's own).",
    )
    enable_thinking: TriState = Field(
        "none", description="qwen3 empty-thought rule: true, false or none (MindSpeed's meaning)."
    )
    map_keys: JsonObject | None = Field(
        None, description='Column and role-tag mapping, e.g. {"messages":"messages","tags":{"role_tag":"role",...}}.'
    )
    json_keys: StrList = Field(default_factory=lambda: ["text"], description="Pretraining: the text column(s).")
    workers: int = Field(1, ge=1, le=256, description="Tokenizing processes.")
    log_interval: int = Field(100, ge=1, description="Samples between progress reports.")
    seq_length: int | None = Field(
        None,
        ge=2,
        description="Instruction samples are cut to fit seq_length - 1 tokens (see overlong_policy); pack bins.",
    )
    pack: bool = Field(False, description="Pack samples into seq_length rows (needs seq_length).")
    neat_pack: bool = Field(False, description="With pack: attention_mask holds 1-based sub-sample ids, 0 on padding.")
    append_eod: bool = Field(
        False,
        description=(
            "Append an end-of-document token to every sample: pretraining documents get the tokenizer's eos; instruction "
            "samples a trained <|im_end|> (qwen/qwen3) or the tokenizer's eos (hf), as MindSpeed does."
        ),
    )
    skip_bad_samples: bool = Field(
        False, description="Count and skip malformed records instead of failing on the first."
    )
    overlong_policy: Literal["truncate", "truncate_head", "drop"] = Field(
        "truncate",
        description=(
            "Instruction samples over seq_length - 1 tokens: truncate = MindSpeed's rule (each prompt/answer pair cut "
            "in proportion until the sample fits; qwen keeps MindSpeed's older rule, whose cut samples reach "
            "seq_length and are dropped); truncate_head = keep the first tokens; drop = leave the sample out. "
            "Whatever the policy, a sample of seq_length tokens or more after append_eod is dropped (MindSpeed's check)."
        ),
    )

    @field_validator("handler_name")
    @classmethod
    def _check_handler(cls, value: str) -> str:
        """A field error (not the model's), so the message shows the name alone, not the whole spec."""
        if value not in HANDLERS:
            raise ValueError(
                f"handler_name: {value!r} is not supported; use one of {', '.join(h for h in HANDLERS if h)}"
            )
        return value

    @model_validator(mode="after")
    def _check_preprocess(self) -> PreprocessSpec:
        instruction = HANDLERS[self.handler_name] != "text"
        if self.prompt_type is not None and self.prompt_type.lower() not in TEMPLATES:
            raise ValueError(f"prompt_type: {self.prompt_type!r} is not supported; use one of {', '.join(TEMPLATES)}")
        if instruction and self.prompt_type is None:
            raise ValueError(f"prompt_type: required with {self.handler_name} (qwen3, qwen or hf)")
        if instruction:  # ValueError "map_keys: ..." for unknown keys or tags
            fmt = handler_format(self.handler_name)
            check_map_keys(fmt, dict(self.map_keys or {}), self.handler_name in PAIRWISE_HANDLERS)
        if self.pack and self.seq_length is None:
            raise ValueError("seq_length: required with pack")
        if self.neat_pack and not self.pack:
            raise ValueError("neat_pack: requires pack")
        if self.pack and not instruction:
            raise ValueError("pack: applies to instruction data only (pretraining samples are packed by the trainer)")
        if self.pack and self.handler_name in ("SharegptStylePairwiseHandler", "AlpacaStylePairwiseHandler"):
            raise ValueError("pack: not for pairwise data (MindSpeed writes one chosen/rejected pair per document)")
        return self


# ---------------------------------------------------------------- stage grpo: rule rewards

RewardName = Literal["exact_match", "contains", "regex", "json_schema", "length", "format", "http"]
HTTP_REWARD_FIELDS = ("url", "timeout_s", "retries", "batch_size", "allowed_hosts")
HTTP_REWARD_MAX_URL = 2048
GRPO_FIELDS = (
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "beta",
    "epsilon",
    "epsilon_high",
    "num_iterations",
    "loss_type",
    "scale_rewards",
    "advantage_eps",
    "kl_clamp",
    "mask_truncated_completions",
    "reward_funcs",
    "reward_weights",
)


def _scale_rewards(value: Any) -> Any:
    """TRL's booleans: true is "group", false is "none"."""
    if value is True:
        return "group"
    if value is False:
        return "none"
    return value


class RewardFunc(_Strict):
    """One built-in rule reward of stage grpo, scored on the completion's text (no user code runs on a worker)."""

    name: RewardName = Field(
        ...,
        description="exact_match (1 if the answer equals the reference answer, whitespace-trimmed), contains (1 if "
        "the answer contains the reference), regex (1 if pattern matches the answer), json_schema (1 if the answer "
        "parses as JSON and validates against schema), length (DAPO's overlong penalty: 0 up to "
        "max_completion_length - overlong_buffer tokens, then linearly down to -1 at max_completion_length), "
        "format (1 if the completion is Qwen3's <think>...</think> block followed by a non-empty answer), http (the "
        'team\'s own reward service at url scores batches: POST {"items": [{prompt, completion, reference}]} answered '
        '{"rewards": [number or null]}).',
    )
    label: str | None = Field(
        None,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The name in the metrics (rewards/<label>/mean) and completions.jsonl; default the name.",
    )
    strip_thinking: bool = Field(
        True,
        description="Score the answer after the <think>...</think> block (exact_match, contains, regex, json_schema).",
    )
    pattern: str | None = Field(None, max_length=2000, description="regex: the pattern (Python `regex` syntax).")
    json_schema: JsonObject | None = Field(None, description="json_schema: the JSON Schema the answer must satisfy.")
    overlong_buffer: int | None = Field(
        None, ge=1, description="length: the tokens before max_completion_length over which the penalty grows to -1."
    )
    url: str | None = Field(
        None,
        max_length=HTTP_REWARD_MAX_URL,
        description="http: the reward service's URL (https; a private or reserved address only where an admin lists "
        "the host in webhook_allowed_hosts).",
    )
    timeout_s: float = Field(10.0, gt=0, le=300, description="http: seconds one POST may take.")
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="http: further tries of a failed batch (backoff 0.5 s, doubling); then it scores NaN.",
    )
    batch_size: int = Field(64, ge=1, le=4096, description="http: completions per POST.")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="http: set by the service at submission (whatever a submitter writes is replaced): the entries "
        "of the admin's webhook_allowed_hosts that let url reach a non-public address; the worker re-checks every "
        "address it connects to against them.",
    )

    @model_validator(mode="after")
    def _check_reward(self) -> RewardFunc:
        needs = {"regex": "pattern", "json_schema": "json_schema", "length": "overlong_buffer"}
        for name, field in needs.items():
            if self.name == name and getattr(self, field) is None:
                raise ValueError(f"{field}: reward {name} needs it")
            if self.name != name and getattr(self, field) is not None:
                raise ValueError(f"{field}: applies to reward {name} only, not {self.name}")
        if self.name == "http" and self.url is None:
            raise ValueError("url: reward http needs it")
        if self.name != "http" and self.model_fields_set & set(HTTP_REWARD_FIELDS):
            field = min(self.model_fields_set & set(HTTP_REWARD_FIELDS))
            raise ValueError(f"{field}: applies to reward http only, not {self.name}")
        if self.url is not None:
            net_rules.parse(
                self.url, HTTP_REWARD_MAX_URL
            )  # "url: ..." (the address is checked at submission and per POST)
        if self.pattern is not None:
            import regex  # type: ignore[import-untyped]

            try:
                regex.compile(self.pattern)
            except regex.error as err:
                raise ValueError(f"pattern: not a valid regular expression ({err})") from err
        if self.json_schema is not None:
            import jsonschema  # type: ignore[import-untyped]

            try:
                jsonschema.validators.validator_for(self.json_schema).check_schema(self.json_schema)
            except jsonschema.SchemaError as err:
                raise ValueError(f"json_schema: not a valid JSON Schema ({err.message})") from err
        return self

    @property
    def key(self) -> str:
        return self.label or self.name


class TrainSpec(JobBase, ParallelArgs, ModelArgs):
    """``pretrain_gpt.py`` / ``posttrain_gpt.py`` under torchrun: pretraining, full and LoRA fine-tuning."""

    kind: Literal["train"] = Field("train", description='Job kind "train" (the discriminator).')
    data_path: DataPathList = Field(..., description="Indexed dataset prefix(es), as produced by preprocess.")
    split: str = Field(
        "969, 30, 1",
        description=(
            "train,valid,test weights over the samples in dataset order (Megatron's): training uses the leading "
            "share, validation the next one; the test share is not used."
        ),
    )
    load: DataPath | None = Field(
        None,
        description="--load: checkpoint to start from: a Megatron checkpoint root (tracker + iter_*) or an HF model directory.",
    )
    save: OutputPath | None = Field(
        None,
        description=(
            "--save: directory for training checkpoints; a retry of the same job resumes from the latest one here. A new "
            "job whose save already holds another job's run is refused unless resume is auto."
        ),
    )
    resume: Literal["auto"] | None = Field(
        None,
        description=(
            "auto: when save already holds another job's run, continue it (its iteration, optimizer and data position; "
            "train_iters must be beyond its iteration); the job's events and result name the run resumed "
            "(resumed_from_job). Unset: such a save is refused at submission (use a new save)."
        ),
    )
    save_interval: int | None = Field(
        None, ge=1, description="--save-interval: iterations between checkpoints (default: only at the end)."
    )
    keep_last_n: int | None = Field(
        None,
        ge=1,
        description=(
            "Retention of the training checkpoints saved every save_interval (model and optimizer state together, "
            "under <save>/train_state): keep the newest n, deleting older ones once a new one is complete (default: "
            "keep all). The final export is never deleted."
        ),
    )
    keep_best_by: BestBy | None = Field(
        None,
        description=(
            "With keep_last_n, also keep the checkpoint with the lowest value of this metric at its iteration: lm_loss "
            '("lm loss", "loss") or val_lm_loss ("val_loss"; needs validation at the saved iterations: save_interval a '
            "multiple of eval_interval, eval_iters > 0)."
        ),
    )
    no_load_optim: bool = Field(False, description="--no-load-optim: do not restore optimizer state from load.")
    no_load_rng: bool = Field(False, description="--no-load-rng: do not restore RNG state from load.")
    exit_on_missing_checkpoint: bool = Field(
        False, description="--exit-on-missing-checkpoint: fail when load holds no checkpoint instead of starting fresh."
    )
    train_iters: int = Field(
        ..., ge=1, description="--train-iters: optimizer steps (each of global_batch_size samples)."
    )
    lr: float = Field(..., ge=0, description="--lr: peak learning rate, reached after warmup.")
    min_lr: float = Field(0.0, ge=0, description="--min-lr: learning rate floor of the decay.")
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = Field(
        "linear",
        description="--lr-decay-style: constant, linear, cosine, inverse-square-root or WSD, from lr down to min_lr.",
    )
    lr_decay_iters: int | None = Field(
        None, ge=1, description="--lr-decay-iters: iterations the decay spans (default: train_iters)."
    )
    lr_warmup_fraction: float | None = Field(
        None,
        ge=0,
        le=1,
        description="--lr-warmup-fraction: warmup as a fraction of lr_decay_iters (overrides lr_warmup_iters).",
    )
    lr_warmup_iters: int = Field(
        0, ge=0, description="--lr-warmup-iters: iterations of linear warmup from lr_warmup_init to lr."
    )
    weight_decay: float = Field(
        0.01,
        ge=0,
        description="--weight-decay: AdamW decoupled weight decay on matrices (biases and norm weights are not decayed).",
    )
    clip_grad: float = Field(
        1.0, ge=0, description="--clip-grad: clip the global gradient L2 norm to this (0: no clipping)."
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="--adam-beta1: AdamW first-moment decay.")
    adam_beta2: float = Field(
        0.999, ge=0, lt=1, description="--adam-beta2: AdamW second-moment decay (MindSpeed's Qwen3 scripts: 0.95)."
    )
    adam_eps: float = Field(1e-8, gt=0, description="--adam-eps: AdamW epsilon.")
    initial_loss_scale: float = Field(
        2.0**32, gt=0, description="--initial-loss-scale: starting dynamic loss scale under fp16."
    )
    min_loss_scale: float = Field(
        1.0, gt=0, description="--min-loss-scale: floor of the dynamic loss scale under fp16."
    )
    loss_scale: float | None = Field(
        None, gt=0, description="--loss-scale: a fixed loss scale under fp16 (default: dynamic)."
    )
    loss_scale_window: int = Field(
        1000, ge=1, description="--loss-scale-window: overflow-free iterations before the dynamic scale doubles."
    )
    hysteresis: int = Field(2, ge=1, description="--hysteresis: overflows tolerated before the dynamic scale halves.")
    recompute_granularity: Literal["full", "selective"] | None = Field(
        None,
        description="--recompute-granularity: activation recomputation, full (whole layers) or selective (attention core).",
    )
    recompute_method: Literal["uniform", "block"] | None = Field(
        None, description="--recompute-method: with full recomputation, uniform or block over the layers."
    )
    recompute_num_layers: int | None = Field(
        None,
        ge=1,
        description="--recompute-num-layers: layers per recomputation group (uniform) or recomputed per stage (block).",
    )
    recompute_activation_function: bool = Field(
        False,
        description="--recompute-activation-function: MindSpeed's recompute of the MLP activation for fc2's backward. "
        "This engine always does it, in every layer (the SwiGLU product is freed after fc2 and rebuilt; "
        "only fc1's output stays saved); accepted for script parity.",
    )
    recompute_activation_function_num_layers: int | None = Field(
        None,
        ge=1,
        description="--recompute-activation-function-num-layers: with recompute_activation_function, the layers "
        "that recompute it; every layer does here (see there).",
    )
    log_interval: int = Field(
        100, ge=1, description="--log-interval: iterations between metric lines (metrics.jsonl, TensorBoard, the log)."
    )
    eval_interval: int = Field(
        1000, ge=1, description=("Score the validation share every this many iterations (and after the last one).")
    )
    eval_iters: int = Field(
        100,
        ge=0,
        description=(
            "Global batches per validation pass (the same ones each pass; fewer when the validation share is smaller). "
            "0 turns validation off. Reported as val_lm_loss / val_lm_ppl metrics and Megatron's validation log line."
        ),
    )
    tensorboard_dir: OutputPath | None = Field(
        None, description="--tensorboard-dir: write TensorBoard event files here as well."
    )
    report_to: list[Literal["mlflow"]] = Field(
        default_factory=list,
        description=(
            'Trackers the service mirrors the job to while it runs (not the engine): ["mlflow"] sends its params, '
            "every metric point with its step and its final state to mlflow_tracking_uri, batched and retried; a "
            "tracker that is down never slows or fails the job (a warning event instead). Unset fields take the "
            "team's default (GET /v1/teams/{team}/tracking); mlflow_tracking_uri is required then."
        ),
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        max_length=2000,
        pattern=r"^https?://[^\s]+$",
        description="The MLflow tracking server report_to mlflow sends to (http or https).",
    )
    mlflow_experiment: str | None = Field(
        None,
        min_length=1,
        max_length=500,
        description="The experiment of the mirrored run (default: the job's metadata.experiment, else its team).",
    )
    mlflow_token_secret: str | None = Field(
        None,
        pattern=r"^[A-Za-z][A-Za-z0-9_.-]{0,99}$",
        description="The name of the team's secret (PUT /v1/secrets/{name}) whose value report_to mlflow sends as "
        "its bearer token; the token itself never goes in a spec.",
    )
    finetune: bool = Field(
        False, description="--finetune: load only the weights (iteration 0, fresh optimizer and RNG) from load."
    )
    stage: Literal["sft", "dpo", "grpo"] | None = Field(
        None,
        description="--stage: sft for supervised fine-tuning on instruction data; dpo for preference training on "
        "pairwise data (is_pairwise_dataset), with the loss dpo_loss_type names; grpo for online RL with rule "
        "rewards (reward_funcs) on the prompts of instruction data (TRL's GRPOTrainer fields).",
    )
    is_pairwise_dataset: bool = Field(
        False,
        description="--is-pairwise-dataset: data_path holds preference pairs "
        "(<prefix>_packed_{chosen,rejected}_{input_ids,labels}_document); needed by stage dpo.",
    )
    dpo_loss_type: Literal["sigmoid", "hinge", "ipo", "simpo", "orpo"] = Field(
        "sigmoid",
        description="--dpo-loss-type: sigmoid (DPO), hinge or ipo against the reference model; simpo or orpo "
        "(LLaMA-Factory's pref_loss names) are reference-free: no reference model is built.",
    )
    dpo_beta: float = Field(0.1, gt=0, description="--dpo-beta: the preference loss's temperature beta.")
    dpo_label_smoothing: float = Field(
        0.0,
        ge=0,
        le=0.5,
        description="--dpo-label-smoothing: conservative DPO, the probability a pair's preference is flipped "
        "(sigmoid only).",
    )
    pref_ftx: float = Field(
        0.0, ge=0, description="--pref-ftx: weight of the SFT loss on the chosen answers added to the loss."
    )
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO's target reward margin gamma (dpo_loss_type simpo).")
    ref_model: DataPath | None = Field(
        None,
        description="--ref-model: the reference model's checkpoint (HF or Megatron; default: load). Not for LoRA "
        "(the reference is the base with the adapters off) nor for simpo/orpo.",
    )
    num_generations: int = Field(
        8, ge=2, description="Stage grpo (TRL): completions sampled per prompt; global_batch_size counts completions."
    )
    max_completion_length: int = Field(512, ge=1, description="Stage grpo (TRL): the most tokens a completion has.")
    temperature: float = Field(
        1.0, gt=0, le=10, description="Stage grpo (TRL): sampling temperature; the loss's log-probs use it too."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Stage grpo (TRL): nucleus sampling mass (1: off).")
    top_k: int | None = Field(None, ge=0, description="Stage grpo (TRL): sample among the k most likely (0/None: off).")
    beta: float = Field(
        0.0, ge=0, description="Stage grpo (TRL): weight of the k3 KL to the reference (0: no reference is built)."
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="Stage grpo (TRL): the ratio's lower clip, 1 - epsilon.")
    epsilon_high: float | None = Field(
        None,
        gt=0,
        description="Stage grpo (TRL, DAPO's clip-higher): the upper clip, 1 + epsilon_high (default epsilon).",
    )
    num_iterations: int = Field(
        1, ge=1, description="Stage grpo (TRL's mu): optimizer steps per batch of completions (each an iteration)."
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "dapo",
        description="Stage grpo (TRL): grpo (mean of per-sequence token means), bnpo (token mean per micro-batch), "
        "dr_grpo (token sum / (completions × max_completion_length)), dapo (token sum / the global batch's tokens).",
    )
    scale_rewards: Annotated[Literal["group", "batch", "none"], BeforeValidator(_scale_rewards)] = Field(
        "group",
        description="Stage grpo (TRL): advantages divided by the group's std, the batch's std, or not at all (Dr. GRPO).",
    )
    advantage_eps: float = Field(
        1e-4, ge=0, description="Stage grpo: added to the std (TRL's 1e-4; MindSpeed-RL and verl use 1e-6)."
    )
    kl_clamp: bool = Field(
        False, description="Stage grpo (MindSpeed-RL): clamp ref - logp to ±20 and the k3 term to ±10."
    )
    mask_truncated_completions: bool = Field(
        False, description="Stage grpo (TRL): completions cut at max_completion_length take no part in the loss."
    )
    reward_funcs: list[RewardFunc] = Field(
        default_factory=list, description="Stage grpo: the built-in rule rewards, summed with reward_weights."
    )
    reward_weights: list[float] | None = Field(
        None, description="Stage grpo (TRL): one weight per reward function (default 1 each)."
    )
    refer_model_iter: int = Field(
        1,
        ge=1,
        description="--refer-model-iter: accepted for script parity; the reference is always the weights the run "
        "started from (ref_model or load), kept when a run resumes.",
    )
    context_parallel_size: int = Field(
        1,
        ge=1,
        description="--context-parallel-size: CP degree, ranks each sequence is split over (world = DP × CP × PP × "
        "TP); each rank holds seq_length / CP tokens of every layer's activations. Ulysses: heads must divide by "
        "TP × CP (KV groups too unless kv_head_repeat_before_uly_alltoall).",
    )
    context_parallel_algo: layout.CpAlgo = Field(
        "ulysses_cp_algo",
        description="--context-parallel-algo: ulysses_cp_algo (all-to-all of heads around attention; heads divide "
        "by TP × CP), megatron_cp_algo (ring attention: K/V blocks passed round the CP ranks, causal "
        "load balance by head/tail chunks; any head count) or hybrid_cp_algo (Ulysses inside groups of "
        "ulysses_degree_in_cp ranks, a ring across them).",
    )
    ulysses_degree_in_cp: int | None = Field(
        None,
        ge=2,
        description="--ulysses-degree-in-cp: hybrid_cp_algo only; the Ulysses ranks inside each ring member (divides "
        "context_parallel_size, below it; heads divide by TP × this, KV groups as for Ulysses).",
    )
    kv_head_repeat_before_uly_alltoall: bool = Field(
        True,
        description="--kv-head-repeat-before-uly-alltoall: Ulysses CP (and hybrid) repeats each KV head when a TP "
        "rank's KV groups do not split over the Ulysses degree, as few times as the split needs (MindSpeed-LLM, where "
        "it is on by default too, repeats them to every query head); false refuses such a layout.",
    )
    use_cp_send_recv_overlap: bool = Field(
        True,
        description="--use-cp-send-recv-overlap: the ring sends the next K/V block while it computes the current one "
        "(false: each transfer completes before the block's compute).",
    )
    cp_attention_mask_type: Literal["causal", "general"] = Field(
        "causal",
        description="--cp-attention-mask-type: causal (packed samples keep their own causal blocks); general is "
        "refused (an arbitrary mask is not taken).",
    )
    precompute_ref_log_probs: bool = Field(
        False,
        description="Stage dpo (TRL's name): compute the reference's log-probs of every pair once, before training, "
        "store them beside the dataset (keyed by the dataset, the reference checkpoint and the numerics) and train "
        "without the reference in memory; a later run with the same key reuses them.",
    )
    is_instruction_dataset: bool = Field(
        False,
        description="--is-instruction-dataset: data_path holds preprocessed instruction data (prompt tokens masked from "
        "the loss). With is_pairwise_dataset (as MindSpeed's DPO and SimPO scripts pass both) it means pairwise "
        "instruction data, read as pairs.",
    )
    variable_seq_lengths: bool = Field(
        False, description="--variable-seq-lengths: pad each micro-batch to its longest sample, not to seq_length."
    )
    prompt_type: str | None = Field(
        None,
        description="--prompt-type: the chat template the data was preprocessed with (qwen3, qwen, hf); recorded for the run.",
    )
    lora_r: int | None = Field(None, ge=1, description="LoRA rank; setting it selects LoRA fine-tuning.")
    lora_alpha: float = Field(
        32, gt=0, description="--lora-alpha: LoRA scale numerator; the update is scaled by lora_alpha / lora_r."
    )
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="--lora-dropout: dropout probability on the LoRA input.")
    lora_target_modules: LoraTargets = Field(
        default_factory=list,
        description="--lora-target-modules: modules the adapters wrap, e.g. linear_qkv linear_proj linear_fc1 linear_fc2.",
    )
    lora_fusion: bool = Field(
        False, description="--lora-fusion: a MindSpeed speed option; accepted for script parity, no effect here."
    )
    save_hf: bool = Field(False, description="Also export the final weights as HF safetensors under <save>/hf.")
    no_save_optim: bool = Field(
        False, description="Training checkpoints hold no optimizer state (a resume restarts Adam)."
    )
    no_save_rng: bool = Field(False, description="Training checkpoints hold no RNG state.")
    lr_warmup_init: float = Field(0.0, ge=0, description="LR at the start of warmup (Megatron).")
    recompute_activations: bool = Field(False, description="Megatron alias of recompute_granularity=selective.")
    use_checkpoint_args: bool = Field(
        False, description="Take the model shape from the checkpoint (always done for unset shape flags)."
    )
    padding_free: bool = Field(
        True,
        description="Engine extension: pack each micro-batch's samples into one row (segment ids, restarted positions), "
        "no padding; false pads each sample to the micro-batch's longest (variable_seq_lengths) or to seq_length.",
    )
    cross_entropy_chunk_size: int = Field(
        256,
        ge=1,
        description="Engine extension: tokens per chunk of the chunked loss (each chunk holds about three fp32 "
        "chunk × vocabulary buffers at its peak: 256 × Qwen3's 151,936 is 467 MB; Liger's fused linear cross-entropy chunks finer).",
    )
    max_micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Engine extension: a micro-batch padding to more token positions (rows × width) fails the job "
        "as bad input, naming its samples, instead of running out of memory. The API sets it at submission when it "
        "admitted the job on its data's largest micro-batch (the memory plan's this_data), so data changed "
        "afterwards fails clearly.",
    )

    use_precision_aware_optimizer: bool = Field(
        False,
        description="--use-precision-aware-optimizer (Megatron-Core): the optimizer keeps its master weights, the "
        "main gradients and each Adam moment in the dtypes main_params_dtype, main_grads_dtype, exp_avg_dtype and "
        "exp_avg_sq_dtype name; the update is computed in fp32 and stored back rounded to nearest even.",
    )
    main_grads_dtype: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        "fp32",
        description="--main-grads-dtype: fp32 or bf16 (Megatron's choices). bf16 (with bf16 true) stores the "
        "trainable weights in bf16: their gradients accumulate over micro-batches in bf16, and the fp32 master "
        "weights live in the optimizer. Needs use_precision_aware_optimizer.",
    )
    main_params_dtype: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        "fp32",
        description="--main-params-dtype: the master weights, fp32 or fp16 (Megatron's choices; fp16 needs "
        "main_grads_dtype bf16, the master then being the optimizer's own copy). Needs use_precision_aware_optimizer.",
    )
    exp_avg_dtype: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        "fp32",
        description="--exp-avg-dtype: Adam's first moment, fp32, bf16 or fp16 (fp8 is refused: it needs per-tensor "
        "scaling that is not built). Needs use_precision_aware_optimizer.",
    )
    exp_avg_sq_dtype: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        "fp32",
        description="--exp-avg-sq-dtype: Adam's second moment, fp32, bf16 or fp16 (fp8 refused, as exp_avg_dtype). "
        "Needs use_precision_aware_optimizer.",
    )
    optimizer_cpu_offload: bool = Field(
        False,
        description="--optimizer-cpu-offload (Megatron-Core): optimizer_offload_fraction of the optimizer state (by "
        "parameters, in model order) kept and stepped on the host: fp32 master weights and moments there, the "
        "gradients copied down, the updated weights copied back. Needs use_precision_aware_optimizer (as Megatron).",
    )
    optimizer_offload_fraction: float = Field(
        1.0, ge=0, le=1, description="--optimizer-offload-fraction: the share of optimizer_cpu_offload (0 to 1)."
    )
    reuse_fp32_param: bool = Field(
        False,
        description="--reuse-fp32-param (MindSpeed): refused (not built). MindSpeed keeps the bf16 weights inside "
        "the fp32 master's bits (the rounded bf16 plus an int16 remainder); here the trainable weights are the fp32 "
        "master and FSDP2 casts bf16 copies per layer, or, with main_grads_dtype bf16, the master is the optimizer's "
        "own fp32 copy. Use use_precision_aware_optimizer (bf16 moments) or optimizer_cpu_offload instead.",
    )
    swap_optimizer: bool = Field(
        False,
        description="--swap-optimizer (MindSpeed): refused; optimizer_cpu_offload with optimizer_offload_fraction 1.0 "
        "frees the same device bytes (the optimizer state lives on the host) and steps on the host instead of "
        "swapping the state back to the device for the step.",
    )

    @model_validator(mode="after")
    def _check_optimizer_precision(self) -> TrainSpec:
        """Megatron's rules for the precision-aware optimizer and its offload; what is not built is refused by name."""
        named = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        if self.reuse_fp32_param:
            raise ValueError(
                "reuse_fp32_param: not supported: MindSpeed's bf16 weights held inside the fp32 master's bits "
                "(rounded bf16 + int16 remainder) are not built here, where the trainable weights are the fp32 master "
                "(or, with main_grads_dtype bf16, the optimizer holds it); use use_precision_aware_optimizer "
                "(bf16 moments) or optimizer_cpu_offload"
            )
        if self.swap_optimizer:
            raise ValueError(
                "swap_optimizer: not supported: use optimizer_cpu_offload with optimizer_offload_fraction 1.0, which "
                "frees the same device bytes and steps on the host instead of swapping the state back for the step"
            )
        for field in named:
            value = getattr(self, field)
            if value == "fp8":
                raise ValueError(f"{field}: fp8 needs per-tensor scaling (Transformer Engine's), not built here")
            if value != "fp32" and not self.use_precision_aware_optimizer:
                raise ValueError(f"{field}: {value} needs use_precision_aware_optimizer true (as in Megatron)")
        if self.main_grads_dtype not in ("fp32", "bf16"):
            raise ValueError(f"main_grads_dtype: fp32 or bf16 (Megatron's choices), not {self.main_grads_dtype}")
        if self.main_grads_dtype == "bf16" and not self.bf16:
            raise ValueError("main_grads_dtype: bf16 main gradients need bf16 true (bf16 weights and compute)")
        if self.main_params_dtype not in ("fp32", "fp16"):
            raise ValueError(f"main_params_dtype: fp32 or fp16 (Megatron's choices), not {self.main_params_dtype}")
        if self.main_params_dtype == "fp16" and self.main_grads_dtype != "bf16":
            raise ValueError(
                "main_params_dtype: fp16 master weights need main_grads_dtype bf16 (with fp32 main gradients the "
                "trainable weights themselves are the fp32 master)"
            )
        if self.optimizer_cpu_offload and not self.use_precision_aware_optimizer:
            raise ValueError("optimizer_cpu_offload: needs use_precision_aware_optimizer true (as in Megatron)")
        if "optimizer_offload_fraction" in self.model_fields_set and not self.optimizer_cpu_offload:
            raise ValueError("optimizer_offload_fraction: applies with optimizer_cpu_offload true only")
        return self

    @model_validator(mode="after")
    def _check_lora_flags(self) -> TrainSpec:
        """LoRA's knobs without lora_r would silently run a full fine-tune: refused, naming the first one."""
        if self.lora_r is None:
            for flag in ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_fusion"):
                if flag in self.model_fields_set:
                    raise ValueError(
                        f"{flag}: applies to LoRA only, and lora_r (the LoRA rank, which selects LoRA) is not set; "
                        f"set lora_r for LoRA fine-tuning, or remove {flag} for a full fine-tune"
                    )
        return self

    @model_validator(mode="after")
    def _check_preference(self) -> TrainSpec:
        """Preference knobs outside stage dpo, or ones its loss ignores, would silently do nothing: refused."""
        pref = ("is_pairwise_dataset", "dpo_loss_type", "dpo_beta", "dpo_label_smoothing", "pref_ftx", "simpo_gamma")
        if self.stage != "dpo":
            ref = () if self.stage == "grpo" else ("ref_model",)  # stage grpo's reference: _check_grpo
            for flag in (*pref, *ref, "refer_model_iter", "precompute_ref_log_probs"):
                if flag in self.model_fields_set:
                    raise ValueError(f"{flag}: applies to stage dpo only (preference training); set stage: dpo")
            return self
        if not self.is_pairwise_dataset:
            raise ValueError("is_pairwise_dataset: stage dpo trains on preference pairs; set is_pairwise_dataset true")
        if self.dpo_label_smoothing and self.dpo_loss_type != "sigmoid":
            raise ValueError(f"dpo_label_smoothing: applies to dpo_loss_type sigmoid only, not {self.dpo_loss_type}")
        if "simpo_gamma" in self.model_fields_set and self.dpo_loss_type != "simpo":
            raise ValueError(f"simpo_gamma: applies to dpo_loss_type simpo only, not {self.dpo_loss_type}")
        if self.ref_model is not None and self.dpo_loss_type in REFERENCE_FREE_LOSSES:
            raise ValueError(f"ref_model: dpo_loss_type {self.dpo_loss_type} is reference-free; remove ref_model")
        if self.ref_model is not None and self.lora_r is not None:
            raise ValueError("ref_model: a LoRA run's reference is its base (load) with the adapters off")
        if self.precompute_ref_log_probs and self.dpo_loss_type in REFERENCE_FREE_LOSSES:
            raise ValueError(
                f"precompute_ref_log_probs: dpo_loss_type {self.dpo_loss_type} is reference-free; nothing to precompute"
            )
        if self.pipeline_model_parallel_size > 1 and self.dpo_loss_type not in REFERENCE_FREE_LOSSES:
            # a frozen copy would need a pipeline of its own; the policy's pipeline computes the reference's
            # log-probs before its first step instead, when it still is the reference
            if not self.precompute_ref_log_probs:
                raise ValueError(
                    f"pipeline_model_parallel_size: stage dpo with dpo_loss_type {self.dpo_loss_type} under pipeline "
                    "parallelism needs precompute_ref_log_probs true (or a reference-free loss: simpo, orpo)"
                )
            if self.ref_model is not None:
                raise ValueError(
                    "ref_model: under pipeline parallelism the reference is the run's starting weights (load); "
                    "remove ref_model or set pipeline_model_parallel_size 1"
                )
        return self

    @model_validator(mode="after")
    def _check_grpo(self) -> TrainSpec:
        """Stage grpo's fields: refused outside it, checked against each other and the batch inside it."""
        if self.stage != "grpo":
            for flag in GRPO_FIELDS:
                if flag in self.model_fields_set:
                    raise ValueError(f"{flag}: applies to stage grpo only (online RL); set stage: grpo")
            return self
        if not self.reward_funcs:
            raise ValueError("reward_funcs: stage grpo needs at least one reward function")
        keys = [f.key for f in self.reward_funcs]
        if len(set(keys)) != len(keys):
            raise ValueError("reward_funcs: two reward functions share a name; give one a label")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights: {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward functions"
            )
        gbs = self.global_batch_size or self.micro_batch_size
        if gbs % self.num_generations:
            raise ValueError(
                f"global_batch_size: {gbs} completions per step is not a multiple of num_generations "
                f"{self.num_generations} (each prompt's group is sampled whole)"
            )
        if self.ref_model is not None and self.beta == 0:
            raise ValueError("ref_model: beta is 0, so no reference is used; set beta or remove ref_model")
        if self.ref_model is not None and self.lora_r is not None:
            raise ValueError("ref_model: a LoRA run's reference is its base (load) with the adapters off")
        if self.kl_clamp and self.beta == 0:
            raise ValueError("kl_clamp: clamps the KL term, which beta 0 leaves out; set beta or remove kl_clamp")
        if self.save_interval is not None and self.save_interval % self.num_iterations:
            raise ValueError(
                f"save_interval: must be a multiple of num_iterations ({self.num_iterations}): a checkpoint falls "
                "between batches of completions"
            )
        if self.seq_length is not None:
            for f in self.reward_funcs:
                if f.overlong_buffer is not None and f.overlong_buffer > self.max_completion_length:
                    raise ValueError(
                        f"overlong_buffer: {f.overlong_buffer} is beyond max_completion_length "
                        f"{self.max_completion_length}"
                    )
        if self.pipeline_model_parallel_size > 1:
            raise ValueError(
                "pipeline_model_parallel_size: stage grpo decodes token by token on the policy's own weights, which "
                "the pipeline schedule does not run (no PP or CP yet; DP, TP and EP do)"
            )
        if self.context_parallel_size > 1:
            raise ValueError(
                "context_parallel_size: stage grpo's decoding keeps each sequence's KV cache whole on one rank, which "
                "context parallelism splits (no PP or CP yet; DP, TP and EP do)"
            )
        dp = max(1, self.resources.world_size // self.tensor_model_parallel_size)  # PP and CP are 1 here; EP is in DP
        if (gbs // self.num_generations) % dp:
            raise ValueError(
                f"global_batch_size: {gbs // self.num_generations} prompts per step ({gbs} completions / "
                f"num_generations {self.num_generations}) do not split over DP {dp} (each rank samples whole groups)"
            )
        if self.eval_iters and "eval_iters" in self.model_fields_set:
            raise ValueError("eval_iters: stage grpo has no validation loss; score the model with an eval job")
        return self

    @model_validator(mode="after")
    def _check_context_parallel(self) -> TrainSpec:
        """What context parallelism composes with so far; the rest is refused by name rather than run wrongly."""
        cp, hybrid = self.context_parallel_size, self.context_parallel_algo == "hybrid_cp_algo"
        if self.ulysses_degree_in_cp is not None and not hybrid:
            raise ValueError("ulysses_degree_in_cp: applies to context_parallel_algo hybrid_cp_algo only")
        if hybrid and cp > 1:
            u = self.ulysses_degree_in_cp
            if u is None or u >= cp or cp % u:
                raise ValueError(
                    f"ulysses_degree_in_cp: hybrid_cp_algo needs a Ulysses degree that divides context_parallel_size "
                    f"{cp} and is below it (got {u})"
                )
        if self.cp_attention_mask_type != "causal":
            raise ValueError("cp_attention_mask_type: only causal is supported")
        if cp == 1:
            return self
        if self.expert_model_parallel_size > 1 and hybrid:
            raise ValueError("expert_model_parallel_size: not supported with hybrid_cp_algo yet")
        return self

    @model_validator(mode="after")
    def _check_recompute(self) -> TrainSpec:
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise ValueError("recompute_method: applies to recompute_granularity full only (as in Megatron)")
        if self.recompute_activation_function_num_layers is not None and not self.recompute_activation_function:
            raise ValueError("recompute_activation_function_num_layers: needs recompute_activation_function")
        return self

    @model_validator(mode="after")
    def _check_retention(self) -> TrainSpec:
        if self.keep_best_by is not None and self.keep_last_n is None:
            raise ValueError("keep_best_by: needs keep_last_n (without it every checkpoint is kept anyway)")
        if self.keep_last_n is not None and self.save_interval is None:
            raise ValueError(
                "keep_last_n: applies to the checkpoints saved every save_interval iterations; set save_interval"
            )
        if self.keep_best_by == "val_lm_loss" and self.save_interval is not None:
            if self.eval_iters == 0:
                raise ValueError("keep_best_by: val_lm_loss needs validation (eval_iters > 0)")
            if self.save_interval % self.eval_interval:
                raise ValueError(
                    f"keep_best_by: val_lm_loss is measured every eval_interval ({self.eval_interval}) "
                    f"iterations; make save_interval ({self.save_interval}) a multiple of it"
                )
        return self

    @property
    def is_lora(self) -> bool:
        """A LoRA fine-tune: ``lora_r`` (the LoRA rank) selects it."""
        return self.lora_r is not None


class ConvertSpec(JobBase):
    """``convert_ckpt.py``: HF <-> Megatron mcore, re-sharding, LoRA merge, adapter export."""

    kind: Literal["convert"] = Field("convert", description='Job kind "convert" (the discriminator).')
    use_mcore_models: bool = Field(
        False,
        description="--use-mcore-models: Megatron-Core checkpoint layout (always written; accepted for script parity).",
    )
    model_type: Literal["GPT"] = Field("GPT", description="--model-type: GPT, the one supported.")
    model_type_hf: Literal["qwen3", "qwen3-moe"] = Field(
        "qwen3",
        description="--model-type-hf: Hugging Face model family, qwen3 or qwen3-moe (read from the checkpoint either way).",
    )
    load_model_type: Literal["hf", "mg"] = Field(
        ...,
        description="--load-model-type: the input, hf (Hugging Face safetensors) or mg (Megatron mcore checkpoint).",
    )
    save_model_type: Literal["hf", "mg"] = Field(..., description="--save-model-type: the output, hf or mg.")
    target_tensor_parallel_size: int = Field(
        1, ge=1, description="--target-tensor-parallel-size: TP degree of a Megatron output."
    )
    target_pipeline_parallel_size: int = Field(
        1, ge=1, description="--target-pipeline-parallel-size: PP degree of a Megatron output."
    )
    target_expert_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "--target-expert-parallel-size: EP degree of a Megatron MoE output; EP rank e's experts go to "
            "mp_rank_TT[_PPP]_EEE (every other tensor is copied into each)."
        ),
    )
    moe_grouped_gemm: bool = Field(
        False,
        description=(
            "--moe-grouped-gemm: write MoE experts as Megatron's GroupedMLP (mlp.experts.weight1/weight2, what "
            "MindSpeed's qwen3-moe scripts train with) instead of SequentialMLP (mlp.experts.local_experts.{i}.*). "
            "Megatron input is read in either layout."
        ),
    )
    num_layer_list: IntList | None = Field(
        None,
        description="--num-layer-list: layers per pipeline stage of the output, e.g. '10,8,8,10' (default: even split).",
    )
    num_layers_per_virtual_pipeline_stage: int | None = Field(
        None, ge=1, description="--num-layers-per-virtual-pipeline-stage: layers per virtual stage of the output."
    )
    load_dir: DataPath = Field(
        ...,
        description=(
            "HF model directory, or Megatron checkpoint root (tracker + iter_*); over the API also a train job's "
            'checkpoint by reference, {"job": ID, "iteration": N} (see GET /v1/jobs/{id}/checkpoints).'
        ),
    )
    save_dir: OutputPath = Field(
        ...,
        description=(
            "Output directory. For hf output into an existing HF model directory (config.json present) the model "
            "goes to <save_dir>/mg2hf/, as MindSpeed's convert_ckpt.py does."
        ),
    )
    tokenizer_model: DataPath | None = Field(
        None, description="Tokenizer file or directory; its files are copied into HF output."
    )
    hf_cfg_dir: DataPath | None = Field(
        None, description="HF directory whose config/tokenizer/generation files seed HF output."
    )
    params_dtype: Literal["fp16", "bf16", "fp32"] | None = Field(
        None,
        description=(
            "Output dtype. Default: the source's dtype (MindSpeed v1 defaults to fp16, which loses bf16 range)."
        ),
    )
    lora_load: DataPath | None = Field(
        None,
        description=(
            "LoRA adapters merged onto load_dir: a Megatron LoRA checkpoint (MindSpeed's or ours) or a Hugging Face PEFT "
            "adapter directory (adapter_config.json + adapter_model.safetensors)."
        ),
    )
    lora_r: int | None = Field(None, ge=1, description="LoRA rank for merging (default: the checkpoint's args.lora_r).")
    lora_alpha: float | None = Field(None, gt=0, description="LoRA alpha; the merge scale is lora_alpha / lora_r.")
    lora_target_modules: LoraTargets = Field(
        default_factory=list,
        description="--lora-target-modules: modules the adapters wrap, e.g. linear_qkv linear_proj (default: the checkpoint's).",
    )
    save_lora_to_hf: bool = Field(False, description="Export only the LoRA adapters as a PEFT directory.")
    lora_merge_rounding: Literal["fp32", "mindspeed"] = Field(
        "fp32",
        description=(
            "LoRA merge arithmetic: fp32 = W + alpha/r · B @ A added in fp32 and rounded once (more accurate); "
            "mindspeed = MindSpeed's exact rounding (the product cast to the weight dtype before scaling and adding; "
            "for bf16 weights 10-20 % of merged values differ from fp32 by one rounding step)."
        ),
    )

    @model_validator(mode="after")
    def _check_convert(self) -> ConvertSpec:
        pp = self.target_pipeline_parallel_size
        if self.num_layer_list is not None and len(self.num_layer_list) != pp:
            raise ValueError(f"num_layer_list: has {len(self.num_layer_list)} stages but target PP is {pp}")
        if self.num_layer_list is not None and self.num_layers_per_virtual_pipeline_stage is not None:
            raise ValueError("num_layer_list: cannot be combined with num_layers_per_virtual_pipeline_stage")
        if self.load_model_type == "hf" and self.save_lora_to_hf and not self.lora_load:
            raise ValueError("save_lora_to_hf: an HF model has no adapters; give the LoRA checkpoint as lora_load")
        if self.save_lora_to_hf and self.save_model_type != "hf":
            raise ValueError("save_lora_to_hf: needs save_model_type hf")
        if (self.lora_r is None) != (self.lora_alpha is None):
            raise ValueError("lora_r: give both lora_r and lora_alpha (the merge scale is alpha / r)")
        return self


class EvalSpec(JobBase, ParallelArgs, ModelArgs):
    """``inference_4_midea_test.py``: generation over a JSONL test set with accuracy, or loss evaluation."""

    kind: Literal["eval"] = Field("eval", description='Job kind "eval" (the discriminator).')
    load: DataPath | None = Field(
        None,
        description=(
            "--load: the model: a Megatron checkpoint root or an HF model directory; over the API also a train job's "
            'checkpoint by reference, {"job": ID, "iteration": N} (see GET /v1/jobs/{id}/checkpoints). Required '
            "unless deployment (or deployment_url) names a running model to generate through."
        ),
    )
    deployment: str | None = Field(
        None,
        max_length=200,
        description="A ready serve job of your team, by the name clients pass as model (served_model_name, name, id, "
        "or one of its lora_adapters): the test set is generated through that deployment instead of loading a "
        "checkpoint; its tokenizer and prompt_type are used unless set (generate mode only).",
    )
    deployment_url: str | None = Field(
        None,
        max_length=2000,
        pattern=r"^https?://",
        description="Engine extension: the URL of a running `python -m engine serve` endpoint to generate through; "
        "the worker sets it from deployment when the job starts.",
    )
    lora_load: DataPath | None = Field(
        None,
        description=(
            "LoRA adapters: ours or MindSpeed's (applied unmerged), or a Hugging Face PEFT adapter directory (merged)."
        ),
    )
    no_load_optim: bool = Field(
        False, description="--no-load-optim: do not read optimizer state (evaluation never needs it)."
    )
    no_load_rng: bool = Field(False, description="--no-load-rng: do not read RNG state.")
    exit_on_missing_checkpoint: bool = Field(
        False, description="--exit-on-missing-checkpoint: fail when load holds no checkpoint."
    )
    eval_data_path: DataPath = Field(
        ..., description="Test set: a JSONL file of conversations (the last assistant turn is the reference answer)."
    )
    eval_data_size: int | None = Field(
        None, ge=1, description="Evaluate only the first this many test lines (default: all)."
    )
    max_new_tokens: int = Field(128, ge=1, description="--max-new-tokens: tokens generated per prompt at most.")
    temperature: float = Field(1.0, ge=0, description="--temperature: sampling temperature (below 1e-3: greedy).")
    top_p: float = Field(0.0, ge=0, le=1, description="--top-p: nucleus sampling probability mass (0: off).")
    top_k: int = Field(0, ge=0, description="--top-k: sample among the k most likely tokens (0: off).")
    prompt_type: str | None = Field(
        None,
        description=(
            "Chat template for prompts, as in preprocess: qwen3 (the default), qwen (MindSpeed's older qwen template) or hf "
            "(the tokenizer's own)."
        ),
    )
    enable_thinking: TriState = Field(
        "none", description="qwen3 template's thinking switch for prompts: true, false or none (MindSpeed's meaning)."
    )
    map_keys: JsonObject | None = Field(
        None,
        description='Column and role-tag mapping of the test set, e.g. {"messages":"messages","tags":{"role_tag":"role",...}}.',
    )
    lora_r: int | None = Field(
        None, ge=1, description="LoRA rank of lora_load's adapters (read from the checkpoint when unset)."
    )
    lora_alpha: float | None = Field(
        None, gt=0, description="--lora-alpha: LoRA scale numerator (read from the checkpoint when unset)."
    )
    lora_target_modules: LoraTargets = Field(
        default_factory=list,
        description="--lora-target-modules: modules the adapters wrap (read from the checkpoint when unset).",
    )
    greedy: bool = Field(
        False, description="Argmax decoding whatever the temperature (temperature below 1e-3 is greedy too)."
    )
    eval_mode: Literal["generate", "loss"] = Field(
        "generate", description="generate: answers and accuracy; loss: loss and perplexity."
    )
    eval_batch_size: int | None = Field(
        None, ge=1, description="Prompts decoded together (left-padded); default micro_batch_size."
    )
    no_kv_cache: bool = Field(False, description="Recompute the whole sequence at every step (for checking the cache).")
    answer_normalization: StrList = Field(
        default_factory=lambda: ["trim"], description="Applied to answer and reference before exact match: trim, case."
    )
    bad_line_policy: Literal["skip", "error"] = Field(
        "skip", description="Test lines without an assistant answer: skip and report them, or fail."
    )
    top_confusions: int = Field(
        10, ge=0, le=1000, description="How many of the most frequent (reference, answer) errors result.json lists."
    )

    @model_validator(mode="after")
    def _check_eval(self) -> EvalSpec:
        if self.prompt_type is not None and self.prompt_type.lower() not in TEMPLATES:
            raise ValueError(f"prompt_type: {self.prompt_type!r} is not supported; use one of {', '.join(TEMPLATES)}")
        unknown = [r for r in self.answer_normalization if r not in ("trim", "case")]
        if unknown:
            raise ValueError(f"answer_normalization: unknown rule(s) {unknown}; known: trim, case")
        if self.lora_load is None and self.lora_r is not None:
            raise ValueError("lora_r: given without lora_load (the adapter checkpoint to apply)")
        self._check_model_source()
        return self

    @property
    def remote(self) -> bool:
        """Generation goes through a running deployment instead of a model loaded here."""
        return self.deployment is not None or self.deployment_url is not None

    def _check_model_source(self) -> None:
        field = "deployment" if self.deployment is not None else "deployment_url"
        if not self.remote:
            if self.load is None:
                raise ValueError("load: required: the model to evaluate (or deployment: a ready serve job)")
        elif self.load is not None or self.lora_load is not None:
            raise ValueError(f"{field}: generates through a running deployment; leave load and lora_load unset")
        elif self.eval_mode == "loss":
            raise ValueError("eval_mode: loss mode needs the model's logits; give load, or use generate mode")


SERVED_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


# Fields a serve spec inherits from the shared argument groups but that mean training only (batches and samples of
# an optimizer step, regularisation, initialisation, optimizer sharding, pipeline stages): refused by name.
SERVE_TRAINING_FIELDS: dict[str, str] = {
    "micro_batch_size": "max_num_seqs",
    "global_batch_size": "max_num_seqs",
    "seq_length": "max_model_len",
    "use_distributed_optimizer": "",
    "num_layer_list": "",
    "num_layers_per_virtual_pipeline_stage": "",
    "sequence_parallel": "",
    "hidden_dropout": "",
    "attention_dropout": "",
    "init_method_std": "",
    "moe_aux_loss_coeff": "",
    "moe_router_load_balancing_type": "",
}


def serve_training_field(name: str) -> str:
    """The refusal of a training field in a serve spec, with the serve field meant when there is one."""
    instead = SERVE_TRAINING_FIELDS[name]
    hint = f"; did you mean {instead!r}?" if instead else ""
    return f"{name}: a training field, not one of serving's{hint}"


class ServeSpec(JobBase, ParallelArgs, ModelArgs):
    """``generate_qwen3_4b_ptd.sh`` as a service: the model behind an OpenAI-compatible API (``docs/serving.md``).
    Runs until cancelled, deleted or idle for ``idle_timeout_s``."""

    kind: Literal["serve"] = Field("serve", description='Job kind "serve" (the discriminator).')
    load: DataPath = Field(
        ...,
        description=(
            "--load: the model: a Megatron checkpoint root or an HF model directory; over the API also a train job's "
            'checkpoint by reference, {"job": ID, "iteration": N}.'
        ),
    )
    lora_load: DataPath | None = Field(
        None, description="LoRA adapters applied to the base: ours or MindSpeed's (unmerged), or an HF PEFT directory."
    )
    lora_r: int | None = Field(None, ge=1, description="LoRA rank of lora_load's adapters (read when unset).")
    lora_alpha: float | None = Field(None, gt=0, description="--lora-alpha of lora_load's adapters (read when unset).")
    lora_target_modules: LoraTargets = Field(
        default_factory=list, description="--lora-target-modules of lora_load's adapters (read when unset)."
    )
    lora_adapters: dict[str, DataPath] = Field(
        default_factory=dict,
        description=(
            "LoRA adapters chosen per request by `model` (vLLM's multi-LoRA): {name: LoRA checkpoint of a train job, "
            'ours or MindSpeed\'s}; over the API also {name: {"job": ID, "iteration": N}}. Not with lora_load.'
        ),
    )
    prompt_type: str | None = Field(
        None, description="Chat template of chat requests: qwen3 (the default), qwen or hf (the tokenizer's own)."
    )
    served_model_name: str | None = Field(
        None,
        pattern=SERVED_NAME,
        description="The name clients pass as `model` (default: the job's name, else its id).",
    )
    max_num_seqs: int = Field(
        16, ge=1, le=1024, description="Sequences decoded together (KV-cache slots); more requests wait in a queue."
    )
    max_model_len: int = Field(
        2048, ge=16, le=1_048_576, description="Prompt + generated tokens of one sequence at most (a slot's length)."
    )
    max_num_batched_tokens: int = Field(
        2048,
        ge=16,
        le=1_048_576,
        description=(
            "Tokens one engine step runs at most (vLLM's knob): every decoding sequence's next token, then chunks of "
            "waiting prompts in what is left; larger: faster first tokens for long prompts, slower steps."
        ),
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the cached keys/values of a prompt prefix another request already computed."
    )
    kv_cache_memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description=(
            "Share of the device memory left after the weights that the KV cache (max_num_seqs × max_model_len) may "
            "take; submission is refused when it needs more. Unset: the cache may use all of it."
        ),
    )
    idle_timeout_s: float | None = Field(
        None, gt=0, description="Stop (successfully) after this many seconds without a request; unset: never."
    )

    @model_validator(mode="after")
    def _check_serve(self) -> ServeSpec:
        if self.prompt_type is not None and self.prompt_type.lower() not in TEMPLATES:
            raise ValueError(f"prompt_type: {self.prompt_type!r} is not supported; use one of {', '.join(TEMPLATES)}")
        training = [f for f in SERVE_TRAINING_FIELDS if f in self.model_fields_set]
        if training:
            raise ValueError(serve_training_field(training[0]))
        if self.lora_load is None and self.lora_r is not None:
            raise ValueError("lora_r: given without lora_load (the adapter checkpoint to apply)")
        if self.pipeline_model_parallel_size > 1:
            raise ValueError("pipeline_model_parallel_size: serving does not pipeline a model; use 1")
        if self.lora_adapters and self.lora_load is not None:
            raise ValueError("lora_adapters: give lora_load (one adapter for every request) or lora_adapters, not both")
        for name in self.lora_adapters:
            if not re.match(SERVED_NAME, name) or name == self.served_model_name:
                raise ValueError(
                    f"lora_adapters: {name!r} must be a model name (letters, digits, ._:/-) other than served_model_name"
                )
        return self


STEP_KINDS = ("preprocess", "convert", "train", "eval")
REFERENCE = re.compile(r"\$\{steps\.([A-Za-z][A-Za-z0-9_-]{0,63})\.outputs\.([A-Za-z0-9_-]+)\}")
_ANY_REFERENCE = re.compile(r"\$\{[^}]*\}?")
REFERENCE_PLACEHOLDER_DIR = ".pipeline-refs"
# The keys of each kind's result.json outputs (the engine's job runners write exactly these); some only with a flag.
OUTPUT_KEYS: dict[str, tuple[str, ...]] = {
    "preprocess": ("data_path", "output_prefix", "files"),
    "convert": ("checkpoint",),
    "train": ("checkpoint", "checkpoint_iteration", "checkpoint_dir", "hf", "tensorboard"),
    "eval": ("predictions", "result"),
}
OUTPUT_FLAGS: dict[tuple[str, str], str] = {("train", "hf"): "save_hf", ("train", "tensorboard"): "tensorboard_dir"}


def _placeholder_path(base: Path, ref: str, key: str) -> str:
    return str(base / REFERENCE_PLACEHOLDER_DIR / ref / key)


def find_references(value: Any, where: str = "") -> list[tuple[str, str, str]]:
    """``(field, step, output key)`` for every ``${steps.<step>.outputs.<key>}`` in a step spec (strings anywhere)."""
    if isinstance(value, dict):
        return [ref for k, v in value.items() for ref in find_references(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [ref for i, v in enumerate(value) for ref in find_references(v, f"{where}.{i}")]
    if not isinstance(value, str):
        return []
    for match in _ANY_REFERENCE.finditer(value):
        if not REFERENCE.fullmatch(match.group(0)):
            raise ValueError(f"{where}: malformed reference {match.group(0)!r}; write ${{steps.<name>.outputs.<key>}}")
    return [(where, m.group(1), m.group(2)) for m in REFERENCE.finditer(value)]


def substitute_references(value: Any, resolve: Callable[[str, str], str]) -> Any:
    """A copy of ``value`` with every reference replaced by ``resolve(step, key)``."""
    if isinstance(value, dict):
        return {k: substitute_references(v, resolve) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute_references(v, resolve) for v in value]
    if isinstance(value, str):
        return REFERENCE.sub(lambda m: resolve(m.group(1), m.group(2)), value)
    return value


# "field: message" raised by a validator, behind pydantic's "Value error, " prefix: the one parser of that shape.
FIELD_MESSAGE = re.compile(r"^(?:Value error, )?([a-z_][a-z0-9_.]*): (.*)$", re.DOTALL)


_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false"}


def error_message(item: Any) -> str:
    """pydantic's message of one error; a string sent where a number or boolean belongs (refused by the strict API)
    says what to send instead."""
    expected = _EXPECTED.get(str(item.get("type")))
    if expected and isinstance(item.get("input"), str):
        return f"expected {expected}, got the string {item['input']!r} (strings are not converted; drop the quotes)"
    return str(item.get("msg", "invalid"))


def first_error(err: ValidationError, prefix: str) -> str:
    """A nested spec's first validation error as "<prefix>.<field>: message" (the kind tag dropped from the path)."""
    item = err.errors()[0]
    parts = [str(p) for p in item.get("loc", ())]
    if parts and parts[0] in STEP_KINDS:
        parts = parts[1:]
    field, message = ".".join(parts), error_message(item)
    named = FIELD_MESSAGE.match(message)
    if named:
        field, message = (f"{field}.{named.group(1)}" if field else named.group(1)), named.group(2)
    return f"{prefix}.{field}: {message}" if field else f"{prefix}: {message}"


class PipelineStep(_Strict):
    """One step of a pipeline; ``${steps.<name>.outputs.<key>}`` in its spec refers to an earlier step's outputs."""

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$",
        description="Step name, unique in the pipeline; referenced as ${steps.<name>.outputs.<key>}.",
    )
    spec: dict[str, Any] = Field(..., description="A preprocess, convert, train or eval spec.")


class PipelineSpec(JobBase):
    """An ordered list of jobs run one after another as child jobs (driven by ``core.pipelines``, not the engine).

    A step's spec may contain ``${steps.<name>.outputs.<key>}`` (whole or inside a string) naming an output of an
    EARLIER step's result.json; it is replaced when that step has succeeded. At submission every step is validated as
    its kind with each reference replaced by a placeholder path inside the first data root
    (``<root>/.pipeline-refs/<step>/<key>``), so references belong in path/string fields. The pipeline's own
    ``resources`` are unused (each step asks for its own).
    """

    kind: Literal["pipeline"] = Field("pipeline", description='Job kind "pipeline" (the discriminator).')
    steps: list[PipelineStep] = Field(
        ...,
        min_length=1,
        max_length=32,
        description="The steps, run in order, each a preprocess, convert, train or eval spec (1 to 32).",
    )
    on_failure: Literal["fail_fast", "continue"] = Field(
        "fail_fast",
        description="fail_fast: the first failed step fails the pipeline and nothing more runs; continue: "
        "later steps still run unless they refer to a step that did not succeed (those are skipped).",
    )

    @model_validator(mode="after")
    def _check_steps(self, info: ValidationInfo) -> PipelineSpec:
        roots = (info.context or {}).get("data_roots") if info.context else None
        read_roots = (info.context or {}).get("read_roots") if info.context else None
        names = [s.name for s in self.steps]
        earlier: list[str] = []
        for i, step in enumerate(self.steps):
            where = f"steps.{i}.spec"
            if step.name in earlier:
                raise ValueError(f"steps.{i}.name: {step.name!r} is already the name of an earlier step")
            if step.spec.get("kind") not in STEP_KINDS:
                raise ValueError(
                    f"{where}.kind: must be one of {', '.join(STEP_KINDS)} (pipelines do not nest), "
                    f"not {step.spec.get('kind')!r}"
                )
            for field, ref, key in find_references(step.spec, where):
                if ref not in names:
                    close = difflib.get_close_matches(ref, names, n=1, cutoff=0.6)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise ValueError(f"{field}: refers to unknown step {ref!r} (steps: {', '.join(names)}){hint}")
                if ref not in earlier:
                    raise ValueError(f"{field}: refers to step {ref!r}, which does not run before step {step.name!r}")
                _check_output_key(field, ref, key, self.steps[names.index(ref)].spec)
            base = Path(roots[0]) if roots else Path("/")
            placeheld = substitute_references(step.spec, functools.partial(_placeholder_path, base))
            try:
                parse_spec(
                    placeheld, data_roots=roots, read_roots=read_roots, strict=bool((info.context or {}).get("strict"))
                )
            except ValidationError as err:
                raise ValueError(first_error(err, where)) from None
            earlier.append(step.name)
        return self


def _check_output_key(field: str, step: str, key: str, producer: dict[str, Any]) -> None:
    """``key`` is an output the producing step's kind writes (with the flag it needs), else a "did you mean"."""
    kind = str(producer.get("kind"))
    keys = OUTPUT_KEYS.get(kind, ())
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{field}: step {step!r} ({kind}) has no output {key!r}; its outputs are {', '.join(keys)}{hint}"
        )
    flag = OUTPUT_FLAGS.get((kind, key))
    if flag and not producer.get(flag):
        raise ValueError(f"{field}: step {step!r} writes output {key!r} only with {flag} set, and it does not set it")


JobSpec = Annotated[
    PreprocessSpec | ConvertSpec | TrainSpec | EvalSpec | ServeSpec | PipelineSpec, Field(discriminator="kind")
]
ModelSpec = TrainSpec | EvalSpec | ServeSpec  # the kinds that build a model: what the loaders and the planner read
SPEC_CLASSES: dict[str, type[JobBase]] = {
    "preprocess": PreprocessSpec,
    "convert": ConvertSpec,
    "train": TrainSpec,
    "eval": EvalSpec,
    "serve": ServeSpec,
    "pipeline": PipelineSpec,
}
_adapter: TypeAdapter[Any] = TypeAdapter(JobSpec)


def spec_to_json(spec: JobBase) -> dict[str, Any]:
    """The stored form of a spec (job row, ``spec.json``): only the fields the user set, plus ``kind`` and the full
    ``resources``. Keeping unset fields out lets the engine tell an explicit flag from a default (a model-shape flag
    left unset comes from the checkpoint's config, not from Megatron's generic default)."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    data["kind"] = spec.kind  # type: ignore[attr-defined]
    data["resources"] = spec.resources.model_dump(mode="json")
    return data


def parse_spec(
    data: dict[str, Any] | str | bytes,
    data_roots: list[str] | None = None,
    read_roots: list[str] | None = None,
    *,
    strict: bool = False,
) -> JobBase:
    """Validate a spec (dict or JSON text); with ``data_roots`` every path must resolve inside them (inputs may also
    resolve inside ``read_roots``); relative paths start at the first of ``data_roots``. ``strict`` (the API) refuses
    a string where a number or boolean belongs ("20", "3e-3", "yes") instead of converting it, in pipeline steps too."""
    context: dict[str, Any] = (
        {"data_roots": data_roots, "read_roots": read_roots or []} if data_roots is not None else {}
    )
    if strict:
        context["strict"] = True
    if isinstance(data, (str, bytes)):
        return _adapter.validate_json(data, context=context or None, strict=strict or None)
    return _adapter.validate_python(data, context=context or None, strict=strict or None)


def load_spec_file(path: str | os.PathLike[str]) -> JobBase:
    return parse_spec(Path(path).read_text())
