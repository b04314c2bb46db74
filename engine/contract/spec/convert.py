"""The convert kind: HF <-> Megatron checkpoints, re-sharding, LoRA merge and adapter export."""

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
    LoraTargets,
    OutputPath,
)


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

    @property
    def target_parallel_dims(self) -> layout.ParallelDims:
        """The output's layout as dims: a checkpoint has no DP, so the least world its EP fits in (DP = EP)."""
        ep = self.target_expert_parallel_size
        return layout.ParallelDims(
            dp=ep, tp=self.target_tensor_parallel_size, pp=self.target_pipeline_parallel_size, ep=ep
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
