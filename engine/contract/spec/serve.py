"""The serve kind: a model behind an OpenAI-compatible API, and the training fields it refuses by name."""

from __future__ import annotations

import re
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
)

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


class ServeSpec(JobBase, LoraLoadArgs, ParallelArgs, ModelArgs):
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
        if self.pipeline_model_parallel_size > 1:
            raise ValueError("pipeline_model_parallel_size: serving does not pipeline a model; use 1")
        self._check_ranks()
        if self.lora_adapters and self.lora_load is not None:
            raise ValueError("lora_adapters: give lora_load (one adapter for every request) or lora_adapters, not both")
        for name in self.lora_adapters:
            if not re.match(SERVED_NAME, name) or name == self.served_model_name:
                raise ValueError(
                    f"lora_adapters: {name!r} must be a model name (letters, digits, ._:/-) other than served_model_name"
                )
        return self

    def _check_ranks(self) -> None:
        """Serving shards by TP only: one node, every rank a TP rank (rank 0 runs the endpoint and the loop); the one
        copy of the rule, for the API and the engine alike."""
        tp, res = self.tensor_model_parallel_size, self.resources
        if res.world_size != tp or res.nnodes != 1:
            raise ValueError(
                "tensor_model_parallel_size: serving runs on one node with every rank a TP rank: "
                f"resources.nproc_per_node must equal tensor_model_parallel_size ({tp}), nnodes 1; got "
                f"{res.nnodes} × {res.nproc_per_node} ranks"
            )
        if tp > 1 and self.lora_adapters:
            raise ValueError("lora_adapters: per-request adapters are served with TP 1 only for now")
