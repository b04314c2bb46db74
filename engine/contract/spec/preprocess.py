"""The preprocess kind: raw data -> Megatron indexed datasets."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from engine.contract.data_formats import HANDLERS, PAIRWISE_HANDLERS, TEMPLATES, check_map_keys, handler_format
from engine.contract.spec.common import (
    DataPath,
    JobBase,
    JsonObject,
    OutputPath,
    StrList,
    TriState,
)


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
