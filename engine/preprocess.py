"""The ``preprocess`` job kind: ``run(spec, run) -> (outputs, summary)`` (MindSpeed ``preprocess_data.py``).

Flow: the main process streams raw records (``readers``) in chunks to ``workers`` processes (``encode.encode_chunk``:
parse, convert, render, batched tokenization), keeps at most ``2 × workers`` chunks in flight, receives results in
input order, packs them when asked (``packing``) and appends them to Megatron indexed datasets (``indexed``) under a
hidden temporary directory beside the output; only when everything is written are the files renamed into place
(``.bin`` first, ``.idx`` last), so an interrupted run never leaves a dataset that looks complete.

Outputs: ``data_path`` (what ``train`` takes as ``data_path``: the output prefix for instruction data, as MindSpeed's
``--data-path``; ``<prefix>_text_document`` for pretraining) and ``files`` (the written file names, comma separated).
Summary: ``samples_read``, ``samples_written``, ``samples_dropped`` ({reason: count}), ``bad_samples_skipped``,
``bad_sample_examples``, ``truncated``, ``tokens`` (sample tokens, padding excluded), ``trained_tokens``,
``masked_token_ratio``, ``sequences`` (rows written), ``pad_tokens``, ``seconds``, ``samples_per_s``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.contract.constants import IGNORE_INDEX
from engine.contract.data_formats import PAIRWISE_HANDLERS, handler_format
from engine.contract.guard import check_output
from engine.contract.indexed import (
    INSTRUCTION_FIELDS,
    PAIRWISE_FIELDS,
    IndexedDatasetWriter,
    boundaries_prefix,
    instruction_prefix,
)
from engine.contract.runfiles import BadInput, RunDir
from engine.contract.spec import PreprocessSpec
from engine.data.encode import ChunkResult, EncodeConfig, encode_chunk, init_worker
from engine.data.formats import Converter, where
from engine.data.packing import pack_rows
from engine.data.readers import count_records, input_files, iter_raw
from engine.data.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

CHUNK_RECORDS = 512  # records per worker task: large enough for batched tokenization, small enough to stream
PACK_WINDOW = 4096  # samples packed together (bounded memory; MindSpeed packs per preprocessing batch too)
MAX_EXAMPLES = 5  # bad-sample messages kept in the summary


def _config(spec: PreprocessSpec) -> EncodeConfig:
    fmt = handler_format(spec.handler_name)
    return EncodeConfig(
        tokenizer_path=str(spec.tokenizer_name_or_path),
        use_fast=not spec.tokenizer_not_use_fast,
        instruction=fmt != "text",
        pairwise=spec.handler_name in PAIRWISE_HANDLERS,
        handler_name=spec.handler_name,
        map_keys=spec.map_keys,
        template=(spec.prompt_type or "").lower() or None,
        enable_thinking=spec.enable_thinking,
        json_keys=tuple(spec.json_keys),
        append_eod=spec.append_eod,
        seq_length=spec.seq_length,
        overlong_policy=spec.overlong_policy,
    )


def _chunks(records: Iterable[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for record in records:
        chunk.append(record)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _map_ordered(fn: Callable[[Any], ChunkResult], items: Iterable[Any], workers: int) -> Iterator[ChunkResult]:
    """``map(fn, items)`` over ``workers`` processes, in order, with a bounded number of tasks in flight."""
    if workers == 1:
        init_worker(False)
        yield from map(fn, items)
        return
    # fork: workers inherit the imported modules; the parent has not run the tokenizer's thread pool yet.
    with mp.get_context("fork").Pool(workers, initializer=init_worker, initargs=(True,)) as pool:
        pending: deque[Any] = deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _remove_dead_partials(final: Path) -> None:
    """Delete temporary directories left by killed runs with this output prefix (their process is gone)."""
    for stale in final.parent.glob(f".{final.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)


class _Outputs:
    """Indexed-dataset writers under a hidden temporary directory; ``commit`` renames them into place."""

    def __init__(self, output_prefix: str, names: list[str], stale: list[str]):
        final = check_output("output_prefix", output_prefix)  # right before writing (engine.contract.guard)
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_dead_partials(final)
        self.tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        self.final = {name: str(final.parent / name) for name in names}
        self.stale = stale
        self.writers = {name: IndexedDatasetWriter(self.tmp / name, np.int32) for name in names}

    def commit(self) -> list[str]:
        for writer in self.writers.values():
            writer.finalize()
        # Old indexes go first: no old .idx may pair with a new .bin, and no stale dataset may outlive this run.
        for prefix in list(self.final.values()) + self.stale:
            Path(prefix + ".idx").unlink(missing_ok=True)
        for prefix in self.stale:
            Path(prefix + ".bin").unlink(missing_ok=True)
        for suffix in (".bin", ".idx"):
            for name, prefix in self.final.items():
                (self.tmp / (name + suffix)).replace(prefix + suffix)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return [Path(p).name + s for p in self.final.values() for s in (".bin", ".idx")]

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()
        shutil.rmtree(self.tmp, ignore_errors=True)


class _Sink:
    """Receives chunk results in order; writes (and packs) samples; keeps the counts for the summary."""

    def __init__(self, spec: PreprocessSpec, config: EncodeConfig, outputs: _Outputs, pad_id: int):
        self.spec, self.config, self.outputs, self.pad_id = spec, config, outputs, pad_id
        self.read = self.written = self.truncated = self.tokens = self.trained = self.pad_tokens = 0
        self.dropped: Counter = Counter()
        self.bad = 0
        self.examples: list[str] = []
        self.window: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, result: ChunkResult) -> None:
        self.read += result.read
        self.dropped.update(result.dropped)
        self.truncated += result.truncated
        for file, number, problem in result.errors:
            if not self.spec.skip_bad_samples:
                raise BadInput(f"{where(file, number)}: {problem}", field="input")
            self.bad += 1
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append(f"{where(file, number)}: {problem}")
        self.written += result.written
        if self.config.pairwise:
            self._write_pairwise(result)
        elif not self.config.instruction:
            self._write_text(result)
        elif self.spec.pack:
            self._buffer(result)
        else:
            self._write_instruction(result.fields["input_ids"], result.fields["labels"], result.lengths["input_ids"])

    def _writer(self, field: str) -> IndexedDatasetWriter:
        name = Path(self.spec.output_prefix).name
        if field == "boundaries":
            return self.outputs.writers[boundaries_prefix(name)]
        if self.config.instruction:
            return self.outputs.writers[instruction_prefix(name, field)]
        return self.outputs.writers[f"{name}_{field}_document"]

    def _write_text(self, result: ChunkResult) -> None:
        for key in self.config.json_keys:
            self._writer(key).add_documents(result.fields[key], result.lengths[key])
            self.tokens += int(result.fields[key].size)

    def _write_pairwise(self, result: ChunkResult) -> None:
        for key in PAIRWISE_FIELDS:
            self._writer(key).add_documents(result.fields[key], result.lengths[key])
        for side in ("chosen", "rejected"):
            self.tokens += int(result.fields[f"{side}_input_ids"].size)
            self.trained += int((result.fields[f"{side}_labels"] != IGNORE_INDEX).sum())

    def _write_instruction(
        self, ids: np.ndarray, labels: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None
    ) -> None:
        self._writer("input_ids").add_documents(ids, lengths)
        self._writer("labels").add_documents(labels, lengths)
        self._writer("attention_mask").add_documents(np.ones_like(ids) if mask is None else mask, lengths)
        self.trained += int((labels != IGNORE_INDEX).sum())
        self.tokens += int(ids.size)  # flush() takes the padding back out

    def _buffer(self, result: ChunkResult) -> None:
        ids, labels = result.fields["input_ids"], result.fields["labels"]
        ends = np.cumsum(result.lengths["input_ids"])
        for start, end in zip(np.concatenate(([0], ends[:-1])), ends, strict=True):
            self.window.append((ids[start:end], labels[start:end]))
        if len(self.window) >= PACK_WINDOW:
            self.flush()

    def flush(self) -> None:
        if not self.window:
            return
        rows = pack_rows(self.window, self.spec.seq_length or 0, self.pad_id, self.spec.neat_pack)
        self.window = []
        lengths = np.asarray([r.input_ids.size for r in rows], dtype=np.int64)
        ids = np.concatenate([r.input_ids for r in rows])
        labels = np.concatenate([r.labels for r in rows])
        mask = np.concatenate([r.attention_mask for r in rows])
        used = int(sum(int(r.boundaries[-1]) for r in rows))
        self._write_instruction(ids, labels, lengths, mask)
        self.tokens -= ids.size - used
        self.pad_tokens += ids.size - used
        self._writer("boundaries").add_documents(
            np.concatenate([r.boundaries for r in rows]), np.asarray([r.boundaries.size for r in rows], np.int64)
        )

    def summary(self, seconds: float) -> dict[str, Any]:
        sequences = next(iter(self.outputs.writers.values())).sequences
        return {
            "samples_read": self.read,
            "samples_written": self.written,
            "samples_dropped": dict(self.dropped),
            "bad_samples_skipped": self.bad,
            "bad_sample_examples": self.examples,
            "truncated": self.truncated,
            "tokens": self.tokens,
            "trained_tokens": self.trained if self.config.instruction else self.tokens,
            "masked_token_ratio": round(1 - self.trained / self.tokens, 6)
            if self.config.instruction and self.tokens
            else 0.0,
            "sequences": sequences,
            "pad_tokens": self.pad_tokens,
            "seconds": round(seconds, 3),
            "samples_per_s": round(self.read / seconds, 1) if seconds > 0 else None,
        }


def _dataset_names(spec: PreprocessSpec, config: EncodeConfig) -> tuple[list[str], list[str]]:
    """(datasets to write, stale datasets to delete) as names relative to the output directory."""
    name = Path(spec.output_prefix).name
    if not config.instruction:
        return [f"{name}_{key}_document" for key in config.json_keys], []
    # MindSpeed globs <prefix>_packed_*_document*: instruction and pairwise files must not coexist under one prefix.
    directory = Path(spec.output_prefix).parent
    names = [instruction_prefix(name, f) for f in INSTRUCTION_FIELDS]
    pairs = [instruction_prefix(name, f) for f in PAIRWISE_FIELDS]
    bounds = boundaries_prefix(name)
    if config.pairwise:
        return pairs, [str(directory / n) for n in [*names, bounds]]
    stale = [str(directory / n) for n in pairs]
    return (names + [bounds], stale) if spec.pack else (names, [*stale, str(directory / bounds)])


def _check(spec: PreprocessSpec, config: EncodeConfig) -> PreTrainedTokenizerBase:
    """Fail fast on setup problems, before any worker starts. Returns the tokenizer."""
    tokenizer = load_tokenizer(config.tokenizer_path, config.use_fast)
    if config.instruction:
        try:
            Converter(spec.handler_name, spec.map_keys)
        except ValueError as err:
            raise BadInput(str(err), field="map_keys") from err
        if config.template == "hf" and getattr(tokenizer, "chat_template", None) is None:
            raise BadInput("prompt_type: hf needs a tokenizer with a chat_template", field="prompt_type")
    return tokenizer


def run(spec: PreprocessSpec, run: RunDir) -> tuple[dict[str, str], dict[str, Any]]:
    """Preprocess ``spec.input`` into indexed datasets at ``spec.output_prefix``; see the module docstring."""
    if int(os.environ.get("RANK", "0")) != 0:  # launched under torchrun with several processes: one writer only
        return {}, {"skipped": f"rank {os.environ['RANK']}: preprocessing runs on global rank 0 only"}
    config = _config(spec)
    tokenizer = _check(spec, config)
    files = input_files(spec.input)
    total = count_records(files)
    names, stale = _dataset_names(spec, config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    log.info(
        "preprocess: %d file(s), ~%s records, handler %s, template %s, enable_thinking %s, %d worker(s)",
        len(files),
        total if total is not None else "?",
        spec.handler_name or "GeneralPretrainHandler",
        config.template,
        config.enable_thinking,
        spec.workers,
    )
    outputs = _Outputs(str(spec.output_prefix), names, stale)
    sink = _Sink(spec, config, outputs, pad_id)
    started = time.monotonic()
    try:
        _process(spec, config, files, total, sink, run, started)
        if sink.written == 0:  # Megatron cannot even open an empty dataset; training would fail later and worse
            raise BadInput(
                f"input: no sample left to write ({sink.read} read, dropped {dict(sink.dropped)}, "
                f"{sink.bad} bad skipped)",
                field="input",
            )
        written = outputs.commit()
    except BaseException:
        outputs.abort()
        raise
    summary = sink.summary(time.monotonic() - started)
    log.info("preprocess summary: %s", summary)
    prefix = str(Path(spec.output_prefix).resolve())  # absolute: the next pipeline step may run elsewhere
    data_path = prefix if config.instruction else f"{prefix}_{config.json_keys[0]}_document"
    return {"data_path": data_path, "output_prefix": prefix, "files": ",".join(written)}, summary


def _process(
    spec: PreprocessSpec,
    config: EncodeConfig,
    files: list[Path],
    total: int | None,
    sink: _Sink,
    run: RunDir,
    started: float,
) -> None:
    from functools import partial

    from tqdm import tqdm

    next_report = spec.log_interval
    with tqdm(total=total, unit="samples", desc="preprocess", disable=None, dynamic_ncols=True) as bar:
        for result in _map_ordered(
            partial(encode_chunk, config), _chunks(iter_raw(files), CHUNK_RECORDS), spec.workers
        ):
            sink.add(result)
            bar.update(result.read)
            if sink.read >= next_report:
                rate = sink.read / max(time.monotonic() - started, 1e-9)
                log.info("processed %d samples (%.1f samples/s), written %d", sink.read, rate, sink.written)
                run.progress(sink.read, total, "samples")
                next_report = (sink.read // spec.log_interval + 1) * spec.log_interval
        sink.flush()
    run.progress(sink.read, sink.read, "samples", f"{sink.read} samples read, {sink.written} written")
