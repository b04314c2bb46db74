"""The train kind: pretraining, full and LoRA fine-tuning, preference training (dpo) and online RL (grpo)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BeforeValidator,
    Field,
    model_validator,
)

from engine.contract import layout
from engine.contract.constants import REFERENCE_FREE_LOSSES
from engine.contract.spec.args import ModelArgs, ParallelArgs
from engine.contract.spec.common import (
    BestBy,
    DataPath,
    DataPathList,
    JobBase,
    LoraTargets,
    OutputPath,
)
from engine.contract.spec.grpo import GRPO_FIELDS, RewardFunc, _scale_rewards


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
        gbs = self.effective_global_batch_size
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
        if self.pipeline_model_parallel_size > 1 and self.sequence_parallel:
            raise ValueError(
                "sequence_parallel: stage grpo's pipelined decoding hands whole hidden states from stage to stage, "
                "not sequence shards (PP with TP runs without sequence_parallel)"
            )
        if self.context_parallel_size > 1 and self.pipeline_model_parallel_size > 1:
            raise ValueError(
                "context_parallel_size: stage grpo under PP decodes stage to stage on whole sequences, and its "
                "schedule's loss takes no CP shards yet (CP runs with DP, TP and EP; PP without CP)"
            )
        dp = self.parallel_dims.dp  # CP ranks decode their DP group's groups together; EP is carved out of DP
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

    @property
    def recompute(self) -> Literal["full", "selective"] | None:
        """The activation recomputation the run does: ``recompute_granularity``, else selective when Megatron's alias
        ``recompute_activations`` is set; the one copy of the rule."""
        if self.recompute_granularity:
            return self.recompute_granularity
        return "selective" if self.recompute_activations else None
