"""The tokenizer of a job that loads a model (eval, serve) and the ids that end an assistant turn."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.contract.runfiles import BadInput
from engine.contract.spec import EvalSpec, ServeSpec
from engine.data.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def spec_tokenizer(spec: EvalSpec | ServeSpec) -> PreTrainedTokenizerBase:
    """The job's tokenizer: ``tokenizer_name_or_path``, else the one saved with the checkpoint ``load``."""
    path = spec.tokenizer_name_or_path or spec.load
    if path is None or (spec.tokenizer_name_or_path is None and not (Path(path) / "tokenizer_config.json").is_file()):
        raise BadInput(
            "tokenizer_name_or_path: required (the checkpoint directory holds no tokenizer)",
            field="tokenizer_name_or_path",
        )
    return load_tokenizer(path, use_fast=not spec.tokenizer_not_use_fast)


def stop_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Token ids that end an assistant turn: ``<|im_end|>`` and the tokenizer's EOS."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return {t for t in (im_end, tokenizer.eos_token_id) if isinstance(t, int) and t >= 0}
