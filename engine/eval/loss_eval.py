"""Loss / perplexity evaluation (``eval_mode=loss``) with the training loss code.

Data: a MindSpeed instruction dataset prefix (``<prefix>_packed_{input_ids,labels,attention_mask}_document``, packed
rows included) or conversation files (JSONL/JSON/parquet/... read like preprocessing input, rendered with the
training template). The loss is ``engine.model.loss.chunked_cross_entropy`` over the tokens the labels mark as
trained (assistant turns), with the labels shifted as in training, summed over tokens and divided by their number
(Megatron's ``lm loss``); perplexity is ``exp(loss)``. Packed rows keep their sub-samples apart: attention stays inside
each (``segment_ids``), positions restart, and no token predicts the first token of the next sub-sample.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from engine.contract.constants import IGNORE_INDEX
from engine.contract.indexed import InstructionDataset, instruction_prefix
from engine.contract.runfiles import BadInput, RunDir
from engine.contract.spec import EvalSpec
from engine.data.formats import Converter, FormatError
from engine.data.readers import RecordError, input_files, iter_raw, parse_record
from engine.data.templates import ConversationError, encode_conversation
from engine.model.decoder_lm import decoder_lm
from engine.model.loss import chunked_cross_entropy
from engine.parallel.device import Device

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

Row = tuple[np.ndarray, np.ndarray, np.ndarray]  # input_ids, labels (token-aligned, unshifted), sub-sample ends


def is_indexed(path: str | os.PathLike[str]) -> bool:
    return Path(instruction_prefix(path, "input_ids") + ".idx").is_file()


def _indexed_rows(prefix: str, limit: int | None) -> Iterator[Row]:
    ds = InstructionDataset(prefix)
    for i in range(len(ds) if limit is None else min(limit, len(ds))):
        s = ds[i]
        yield np.asarray(s.input_ids), np.asarray(s.labels), np.asarray(s.boundaries)


def _conversation_rows(spec: EvalSpec, tokenizer: PreTrainedTokenizerBase, bad: list[dict[str, Any]]) -> Iterator[Row]:
    try:
        converter = Converter("SharegptStyleInstructionHandler", spec.map_keys)
        files = input_files(spec.eval_data_path)
    except (ValueError, BadInput) as err:
        raise BadInput(f"eval_data_path: {err}", field="eval_data_path") from err
    seen = 0
    for file, number, payload in iter_raw(files):
        if spec.eval_data_size is not None and seen >= spec.eval_data_size:
            return
        seen += 1
        try:
            messages = converter.messages(parse_record(payload))
            ids, labels = encode_conversation(tokenizer, messages, spec.prompt_type or "qwen3", spec.enable_thinking)
            if spec.seq_length is not None and len(ids) > spec.seq_length:
                raise RecordError(f"{len(ids)} tokens, more than seq_length {spec.seq_length}")
        except (RecordError, FormatError, ConversationError) as err:
            if spec.bad_line_policy == "error":
                raise BadInput(f"eval_data_path: {file}:{number}: {err}", field="eval_data_path") from err
            bad.append({"line": number, "reason": str(err)})
            continue
        yield ids, labels, np.asarray([len(ids)], dtype=np.int64)


def _batch(rows: list[Row], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded (B, T) tensors: ids, shifted targets, positions restarting per sub-sample, segment ids."""
    width = max(len(r[0]) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    targets = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    pos = np.zeros((len(rows), width), dtype=np.int64)
    seg = np.zeros((len(rows), width), dtype=np.int64)  # 0 = padding, k = k-th sub-sample
    for b, (row_ids, labels, ends) in enumerate(rows):
        n = len(row_ids)
        ids[b, :n] = row_ids
        targets[b, : n - 1] = labels[1:n]  # token t predicts label t+1
        start = 0
        for k, end in enumerate(ends.tolist(), 1):
            pos[b, start:end] = np.arange(end - start)
            seg[b, start:end] = k
            targets[b, end - 1] = IGNORE_INDEX  # the last token of a sub-sample predicts nothing inside it
            start = end
    as_t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return {"input_ids": as_t(ids), "targets": as_t(targets), "position_ids": as_t(pos), "segment_ids": as_t(seg)}


@torch.inference_mode()
def _loss_of(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_size: int) -> tuple[float, int]:
    hidden = model(
        batch["input_ids"], position_ids=batch["position_ids"], segment_ids=batch["segment_ids"], return_hidden=True
    )
    loss_sum, tokens = chunked_cross_entropy(hidden, decoder_lm(model).output_weight(), batch["targets"], chunk_size)
    return float(loss_sum), int(tokens)


def _rows(spec: EvalSpec, tokenizer: PreTrainedTokenizerBase, bad: list[dict[str, Any]]) -> Iterator[Row]:
    if is_indexed(spec.eval_data_path):
        return _indexed_rows(spec.eval_data_path, spec.eval_data_size)
    return _conversation_rows(spec, tokenizer, bad)


def run_loss_eval(
    spec: EvalSpec,
    run: RunDir,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    device: Device,
    info: dict[str, Any],
) -> tuple[dict[str, str], dict[str, Any]]:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch_size = spec.eval_batch_size or spec.micro_batch_size
    bad: list[dict[str, Any]] = []
    mine = [r for i, r in enumerate(_rows(spec, tokenizer, bad)) if i % world == rank]
    loss_sum, tokens, start = 0.0, 0, time.perf_counter()
    for step, first in enumerate(range(0, len(mine), batch_size)):
        part_loss, part_tokens = _loss_of(
            model, _batch(mine[first : first + batch_size], pad, device.torch_device), 1024
        )
        loss_sum, tokens = loss_sum + part_loss, tokens + part_tokens
        run.metric(step, {"lm_loss": part_loss / max(part_tokens, 1)})
        run.progress(min(len(mine), first + batch_size) * world, len(mine) * world, "sequences")
    gathered = gather_objects((loss_sum, tokens, len(mine), time.perf_counter() - start))
    loss_sum, tokens = sum(g[0] for g in gathered), sum(g[1] for g in gathered)
    if tokens == 0:
        raise BadInput(
            f"eval_data_path: {spec.eval_data_path} has no trained (labelled) token to evaluate", field="eval_data_path"
        )
    for b in bad[:50]:
        run.event("warning", f"{spec.eval_data_path}: line {b['line']} skipped: {b['reason']}", **b)
    loss = loss_sum / tokens
    wall = max(g[3] for g in gathered)
    summary = {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "tokens": tokens,
        "sequences": sum(g[2] for g in gathered),
        "skipped": len(bad),
        "skipped_lines": bad[:50],
        "tokens_per_s": tokens / max(wall, 1e-9),
        "world_size": world,
        "model": info,
    }
    log.info("loss %.4f, perplexity %.3f over %d tokens", loss, summary["perplexity"], tokens)
    return ({"result": str(run.path / "result.json")} if run.is_writer else {}), summary


T = TypeVar("T")


def gather_objects(obj: T) -> list[T]:
    """``obj`` of every rank, in rank order (just ``[obj]`` without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [obj] * dist.get_world_size()  # every place overwritten by the gather
    dist.all_gather_object(out, obj)
    return out
