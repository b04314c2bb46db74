"""Tokenizer loading: ``transformers.AutoTokenizer`` from a local directory, never the network."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from engine.contract.runfiles import BadInput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@lru_cache(maxsize=4)
def load_tokenizer(path: str | os.PathLike[str], use_fast: bool = True) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in directory ``path`` (tokenizer.json / vocab files / tokenizer_config.json).

    Cached per process: the preprocessing workers and evaluation call this repeatedly.
    Raises ``BadInput`` (field ``tokenizer_name_or_path``) when the directory is missing or unreadable.
    """
    from transformers import AutoTokenizer  # heavy import, kept out of module import time

    directory = Path(path)
    if not directory.is_dir():
        raise BadInput(f"tokenizer_name_or_path: {str(path)!r} is not a directory", field="tokenizer_name_or_path")
    try:
        return AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, use_fast=use_fast, trust_remote_code=False
        )
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds; all mean "cannot load"
        raise BadInput(
            f"tokenizer_name_or_path: cannot load a tokenizer from {str(path)!r}: {err}", field="tokenizer_name_or_path"
        ) from err
