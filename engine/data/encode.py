"""Worker side of preprocessing: a chunk of raw records -> token arrays, with per-record errors and drop reasons.

``encode_chunk(config, chunk)`` runs in a worker process (or inline with one worker). It parses, converts, renders and
tokenizes a chunk with one batched fast-tokenizer call, applies the over-long policy and returns a ``ChunkResult``
whose arrays are flat (one concatenation per field plus per-sample lengths) so that little is pickled back.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.contract.constants import IGNORE_INDEX
from engine.contract.indexed import PAIRWISE_FIELDS
from engine.data.formats import Converter, FormatError, text_fields
from engine.data.readers import RecordError, parse_record
from engine.data.templates import (
    IM_END,
    ConversationError,
    encode_conversations,
    encode_pair,
)
from engine.data.tokenizer import load_tokenizer
from engine.data.truncation import limit_sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Chunk = list[tuple[str, int, Any]]  # (file, number, payload) from readers.iter_raw


@dataclass(frozen=True)
class EncodeConfig:
    """What a worker needs; picklable."""

    tokenizer_path: str
    use_fast: bool
    instruction: bool
    pairwise: bool  # preference pairs (SharegptStylePairwiseHandler / AlpacaStylePairwiseHandler)
    handler_name: str
    map_keys: dict[str, Any] | None
    template: str | None
    enable_thinking: str
    json_keys: tuple[str, ...]
    append_eod: bool
    seq_length: int | None  # samples of seq_length tokens or more are cut or dropped (truncation.limit_sample)
    overlong_policy: str  # truncation.POLICIES


@dataclass
class ChunkResult:
    fields: dict[str, np.ndarray]  # name -> flat int32 tokens of the kept samples
    lengths: dict[str, np.ndarray]  # name -> int64 per-sample lengths
    read: int = 0
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0
    errors: list[tuple[str, int, str]] = field(default_factory=list)  # (file, number, problem)

    @property
    def written(self) -> int:
        first = next(iter(self.lengths.values()), None)
        return 0 if first is None else int(first.size)


def init_worker(parallel: bool) -> None:
    """Pool initializer: one tokenizer thread per worker process when processes give the parallelism."""
    if parallel:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"


def _flatten(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.asarray([a.size for a in arrays], dtype=np.int64)
    flat = np.concatenate(arrays).astype(np.int32, copy=False) if arrays else np.zeros(0, np.int32)
    return flat, lengths


def _limit(
    config: EncodeConfig, ids: np.ndarray, labels: np.ndarray, eod: int | None, result: ChunkResult
) -> tuple[np.ndarray, np.ndarray] | None:
    """Apply the over-long policy and ``append_eod``; None = drop (the reason is counted)."""
    ids, labels, outcome = limit_sample(
        ids, labels, config.seq_length, config.overlong_policy, config.template or "", eod
    )
    if outcome == "too_long":
        result.dropped["too_long"] += 1
        return None
    result.truncated += outcome == "truncated"
    if not (labels != IGNORE_INDEX).any():
        result.dropped["no_trained_tokens"] += 1
        return None
    return ids, labels


def instruction_eod(tokenizer: PreTrainedTokenizerBase, template: str | None) -> int:
    """MindSpeed's ``tokenizer.eod`` for instruction data: qwen/qwen3 replace the eos token with ``<|im_end|>``
    (``replace_eos`` in ``configs/finetune/templates.json``); ``hf`` keeps the tokenizer's own eos."""
    if template in ("qwen", "qwen3"):
        eod = tokenizer.convert_tokens_to_ids(IM_END)
        assert isinstance(eod, int)  # one token in, one id out
        return eod
    return int(tokenizer.eos_token_id)


def _encode_instruction(
    config: EncodeConfig, records: list[tuple[str, int, dict[str, Any]]], result: ChunkResult
) -> None:
    tokenizer = load_tokenizer(config.tokenizer_path, config.use_fast)
    converter = Converter(config.handler_name, config.map_keys)
    good: list[tuple[str, int, list[dict[str, str]]]] = []
    for file, number, record in records:
        try:
            good.append((file, number, converter.messages(record)))
        except FormatError as err:
            result.errors.append((file, number, str(err)))
    template = config.template or ""
    encoded: list[tuple[np.ndarray, np.ndarray]] = []
    try:
        encoded = encode_conversations(tokenizer, [m for _, _, m in good], template, config.enable_thinking)
    except ConversationError:  # isolate the bad record(s): encode one by one
        for file, number, messages in good:
            try:
                encoded.append(encode_conversations(tokenizer, [messages], template, config.enable_thinking)[0])
            except ConversationError as err:
                result.errors.append((file, number, str(err)))
    eod = instruction_eod(tokenizer, config.template) if config.append_eod else None
    kept = [limited for pair in encoded if (limited := _limit(config, *pair, eod, result)) is not None]
    result.fields["input_ids"], result.lengths["input_ids"] = _flatten([ids for ids, _ in kept])
    result.fields["labels"], result.lengths["labels"] = _flatten([labels for _, labels in kept])


def _encode_pairwise(config: EncodeConfig, records: list[tuple[str, int, dict[str, Any]]], result: ChunkResult) -> None:
    """MindSpeed ``AlpacaStylePairwiseHandler._filter``: chosen/rejected ids = prompt + answer, labels mask the prompt.
    No truncation and no eod (MindSpeed has neither for pairs); a pair with any field of ``seq_length`` tokens or more
    is dropped whole (``_serialize_to_disk``'s shared skip indices)."""
    tokenizer = load_tokenizer(config.tokenizer_path, config.use_fast)
    converter = Converter(config.handler_name, config.map_keys)
    kept: dict[str, list[np.ndarray]] = {key: [] for key in PAIRWISE_FIELDS}
    for file, number, record in records:
        try:
            prompt_ids, chosen, rejected = encode_pair(
                tokenizer, *converter.pair(record), config.template or "", config.enable_thinking
            )
        except (FormatError, ConversationError) as err:
            result.errors.append((file, number, str(err)))
            continue
        masked = np.full(prompt_ids.size, IGNORE_INDEX, np.int32)
        row = {
            "chosen_input_ids": np.concatenate([prompt_ids, chosen]),
            "chosen_labels": np.concatenate([masked, chosen]),
            "rejected_input_ids": np.concatenate([prompt_ids, rejected]),
            "rejected_labels": np.concatenate([masked, rejected]),
        }
        if config.seq_length is not None and max(a.size for a in row.values()) >= config.seq_length:
            result.dropped["too_long"] += 1
            continue
        for key, array in row.items():
            kept[key].append(array.astype(np.int32))
    for key in PAIRWISE_FIELDS:
        result.fields[key], result.lengths[key] = _flatten(kept[key])


def _encode_text(config: EncodeConfig, records: list[tuple[str, int, dict[str, Any]]], result: ChunkResult) -> None:
    tokenizer = load_tokenizer(config.tokenizer_path, config.use_fast)
    texts: list[list[str]] = []
    for file, number, record in records:
        try:
            texts.append(text_fields(record, list(config.json_keys)))
        except FormatError as err:
            result.errors.append((file, number, str(err)))
    eod = [tokenizer.eos_token_id] if config.append_eod else []
    per_key = {
        key: tokenizer([t[k] for t in texts], add_special_tokens=False)["input_ids"] if texts else []
        for k, key in enumerate(config.json_keys)
    }
    keep = [i for i in range(len(texts)) if any(per_key[k][i] for k in config.json_keys)]
    result.dropped["empty_text"] += len(texts) - len(keep)
    for key in config.json_keys:
        arrays = [np.asarray(per_key[key][i] + eod, dtype=np.int32) for i in keep]
        result.fields[key], result.lengths[key] = _flatten(arrays)


def encode_chunk(config: EncodeConfig, chunk: Chunk) -> ChunkResult:
    """Process one chunk of raw records (see the module docstring)."""
    result = ChunkResult(fields={}, lengths={}, read=len(chunk))
    records = []
    for file, number, payload in chunk:
        try:
            records.append((file, number, parse_record(payload)))
        except RecordError as err:
            result.errors.append((file, number, str(err)))
    encode = _encode_pairwise if config.pairwise else _encode_instruction if config.instruction else _encode_text
    encode(config, records, result)
    result.dropped = +result.dropped  # drop zero counts
    result.errors.sort(key=lambda e: (e[0], e[1]))  # files are read in sorted order, so this is input order
    return result
