"""The eval kind: generation over a test set with accuracy, or the loss (locally or through a deployment)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from engine.contract.data_formats import TEMPLATES
from engine.contract.spec.args import LoraLoadArgs, ModelArgs, ParallelArgs
from engine.contract.spec.common import (
    DataPath,
    JobBase,
    JsonObject,
    StrList,
    TriState,
)


class EvalSpec(JobBase, LoraLoadArgs, ParallelArgs, ModelArgs):
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
