"""The flag groups the kinds that build a model share: ``ModelArgs`` (the shape, Megatron's ``GPT_ARGS``),
``ParallelArgs`` (the parallel layout, checked by ``engine.contract.layout``) and ``LoraLoadArgs`` (the adapters eval
and serve apply to their base)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from engine.contract import layout
from engine.contract.spec.common import (
    DataPath,
    IntList,
    JobBase,
    LayerFreq,
    LoraTargets,
    _Strict,
)


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

    @property
    def effective_global_batch_size(self) -> int:
        """Samples per optimizer step: ``global_batch_size``, else ``micro_batch_size`` × DP (Megatron's default);
        the one copy of the rule."""
        return self.global_batch_size or self.micro_batch_size * self.parallel_dims.dp


class LoraLoadArgs(_Strict):
    """LoRA adapters applied to the loaded base (eval and serve: ``engine.load.adapters`` reads them for both).
    convert's ``lora_load`` is not this group: it merges the adapters into the checkpoint it writes."""

    lora_load: DataPath | None = Field(
        None,
        description=(
            "LoRA adapters applied to the base: ours or MindSpeed's (unmerged), or a Hugging Face PEFT adapter "
            "directory (merged)."
        ),
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

    @model_validator(mode="after")
    def _check_lora_load(self) -> LoraLoadArgs:
        if self.lora_load is None and self.lora_r is not None:
            raise ValueError("lora_r: given without lora_load (the adapter checkpoint to apply)")
        return self
