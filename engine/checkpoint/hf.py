"""Hugging Face safetensors checkpoints: lazy reading and streaming, sharded writing.

Reading (``HFCheckpoint``) parses each file's header and ``pread``s a tensor (or the rows one TP rank needs,
straight into their place in a fused shard) only when asked for (``engine.checkpoint.reader``), so converting never
holds the model; when no value changes it only names the byte ranges (``shard_segments``), which are copied as they are
(``engine.checkpoint.fastcopy``).
Writing (``save_hf``) plans every shard's header from the shapes first (a dry run of the mapping on meta tensors),
then writes tensors one at a time as the mapping produces them: peak memory is about one layer, not one shard.
The layout is what ``transformers.save_pretrained`` writes: config.json, generation_config.json,
``model-XXXXX-of-YYYYY.safetensors`` and ``model.safetensors.index.json`` (``metadata.total_size`` + ``weight_map``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import torch

from engine.checkpoint.durable import fsync_dir, fsync_tree
from engine.checkpoint.fastcopy import Piece, RowPlan, Segment, coalesce, copy_segments, size_of
from engine.checkpoint.layout import FINAL_NORM, layer_of, native_shapes, shard, split_rule
from engine.checkpoint.reader import SafetensorsFile, TensorRef
from engine.checkpoint.sources import NativeTensors
from engine.checkpoint.torchfile import BackgroundWriter, tensor_bytes
from engine.contract.constants import QWEN3_ENDOFTEXT_ID, QWEN3_IM_END_ID
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput
from engine.dtypes import HF_DTYPE_NAMES, SAFETENSORS_NAMES
from engine.model.hf_mapping import hf_from_native, native_keys, native_row_runs, rule_of

Getter = Callable[[str], torch.Tensor]
Progress = Callable[[int, int], None]

DEFAULT_SHARD_BYTES = 5_000_000_000  # transformers' "5GB": the seed's 8 GB Qwen3-4B became 2 files
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
)
# Qwen3's published generation_config.json, used when the source has none.
QWEN3_GENERATION = {
    "bos_token_id": QWEN3_ENDOFTEXT_ID,
    "do_sample": True,
    "eos_token_id": [QWEN3_IM_END_ID, QWEN3_ENDOFTEXT_ID],
    "pad_token_id": QWEN3_ENDOFTEXT_ID,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


# ---------------------------------------------------------------- reading


class HFCheckpoint:
    """An HF Qwen3 directory (config.json + safetensors), read lazily and checked against its config up front."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise BadInput(f"{config_file}: missing (an HF model directory needs config.json)", field="load_dir")
        try:
            self.hf_config: dict[str, Any] = json.loads(config_file.read_text())
            self.config = ModelConfig.from_hf(self.hf_config)
        except (ValueError, KeyError) as err:
            raise BadInput(f"{config_file}: not a usable Qwen3 config ({err})", field="load_dir") from err
        self._handles: dict[str, SafetensorsFile] = {}
        self._files = self._weight_map()
        self._refs: dict[str, TensorRef] = {}
        self._plans: dict[tuple[str, int, int], list[tuple[str, int, int]]] = {}  # one layer's row runs
        self._shapes = native_shapes(self.config)
        self._check()

    def _weight_map(self) -> dict[str, str]:
        index = self.path / INDEX
        if index.is_file():
            try:
                return dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError) as err:
                raise BadInput(f"{index}: not a safetensors index ({err})", field="load_dir") from err
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise BadInput(
                f"{self.path}: no *.safetensors files (only safetensors checkpoints are read)", field="load_dir"
            )
        return {key: name for name in files for key in self._open(name).tensors}

    def _open(self, name: str) -> SafetensorsFile:
        if name not in self._handles:
            file = self.path / name
            if not file.is_file():
                raise BadInput(f"{file}: missing (listed in {INDEX})", field="load_dir")
            self._handles[name] = SafetensorsFile(file)
        return self._handles[name]

    def _check(self) -> None:
        """Every tensor the config needs is present with the right shape (headers only, no data)."""
        for name in sorted(set(self._files.values())):
            self._refs.update(self._open(name).tensors)
        for key, shape in expected_hf_shapes(self.config).items():
            if key not in self._files or key not in self._refs:
                raise BadInput(f"{self.path}: tensor {key} is missing", field="load_dir")
            if self._refs[key].shape != shape:
                raise BadInput(
                    f"{self.path / self._files[key]}: tensor {key} has shape {list(self._refs[key].shape)}, "
                    f"config.json implies {list(shape)}",
                    field="load_dir",
                )

    @property
    def dtype(self) -> torch.dtype:
        return self._refs["model.embed_tokens.weight"].dtype

    def keys(self) -> list[str]:
        return list(self._files)

    def get(self, key: str) -> torch.Tensor:
        """The HF tensor ``key``, read from its file."""
        return self._ref(key).read()

    def _ref(self, key: str) -> TensorRef:
        if key not in self._refs:
            raise BadInput(f"{self.path}: tensor {key} is missing", field="load_dir")
        return self._refs[key]

    def get_native(self, key: str) -> torch.Tensor:
        """The native (Megatron TP1) tensor ``key``, fused from its HF tensors."""
        return self.get_native_shard(key, 1, 0)

    def get_native_shard(self, key: str, tp: int, rank: int) -> torch.Tensor:
        """TP rank ``rank``'s piece of native ``key``, reading only its rows straight into place."""
        cols = self._column_source(key, tp)
        if cols is not None:  # row-parallel: columns of the one HF tensor, or of each expert's (stacked)
            width = cols[0].shape[1] // tp
            parts = [ref.read_cols(rank * width, (rank + 1) * width) for ref in cols]
            return torch.stack(parts) if len(self._shapes.get(key, ())) > 2 else parts[0]
        out = self._read_runs(self._runs(key, tp, rank))
        shape = self._shapes.get(key)
        return out.view(shape[0], -1, shape[-1]) if shape is not None and len(shape) > 2 else out  # (E, rows, H)

    def get_experts(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Experts [lo, hi) of the stacked native expert tensor ``key`` (hi-lo, rows, H), their HF rows read
        straight into place (the key map run on row numbers, ``native_row_runs``)."""
        try:
            runs = native_row_runs(key, self.config, lambda k: self._ref(k).shape[0], lambda ids: ids[lo:hi])
        except KeyError:
            raise KeyError(key) from None
        out = self._read_runs(runs)
        return out.view(hi - lo, -1, *out.shape[1:])

    def _read_runs(self, runs: list[tuple[str, int, int]]) -> torch.Tensor:
        """HF row runs ``(key, start, stop)`` read one after another into one new tensor."""
        first = self._ref(runs[0][0])
        out = torch.empty((sum(stop - start for _, start, stop in runs), *first.shape[1:]), dtype=first.dtype)
        at = 0
        for hf_key, start, stop in runs:
            self._ref(hf_key).read_rows(start, stop, out[at : at + stop - start])
            at += stop - start
        return out

    def shard_segments(self, key: str, tp: int, rank: int, dtype: torch.dtype) -> list[Piece] | None:
        """The file byte ranges that make up ``get_native_shard(key, tp, rank)`` in order, when it is a plain
        rearrangement of rows in ``dtype``; None when it needs computing (a cast, or a column slice)."""
        if self._column_source(key, tp) is not None:
            return None
        runs = self._runs(key, tp, rank)
        if any(self._ref(hf_key).dtype != dtype for hf_key, _, _ in runs):
            return None
        return coalesce(self._segment(*run) for run in runs)

    def _column_source(self, key: str, tp: int) -> list[TensorRef] | None:
        """The HF tensors (one; one per expert for stacked experts) a row-parallel (dim-1) shard is cut from, when
        ``tp`` cuts it; else None."""
        if tp == 1 or split_rule(key) != "dim1":
            return None
        hf_keys, _ = rule_of(key, self.config)
        return [self._ref(hf_key) for hf_key in hf_keys]

    def _runs(self, key: str, tp: int, rank: int) -> list[tuple[str, int, int]]:
        """(HF key, first row, end row) runs of TP rank ``rank``'s rows of ``key``, from the one key map."""
        try:
            rule_of(key, self.config)
        except KeyError:
            raise KeyError(key) from None
        parsed = layer_of(key)
        if parsed is None:
            return native_row_runs(
                key, self.config, lambda k: self._ref(k).shape[0], lambda ids: shard(ids, split_rule(key), tp, rank)
            )
        # Every layer with this tensor has the same rows: plan the first one's once per (tensor, TP rank), rename
        # for layer i.
        layer, suffix = parsed
        cached = self._plans.get((suffix, tp, rank))
        if cached is None:
            planned = native_row_runs(
                key, self.config, lambda k: self._ref(k).shape[0], lambda ids: shard(ids, split_rule(key), tp, rank)
            )
            cached = self._plans[(suffix, tp, rank)] = [
                (hf_key.removeprefix(f"model.layers.{layer}."), a, b) for hf_key, a, b in planned
            ]
        prefix = f"model.layers.{layer}."
        return [(prefix + hf_key, a, b) for hf_key, a, b in cached]

    def _segment(self, hf_key: str, start: int, stop: int) -> Segment:
        ref = self._ref(hf_key)
        return (ref.file.fd, ref.offset + start * ref.row_bytes, (stop - start) * ref.row_bytes)

    def lora_modules(self) -> list[str]:
        return []  # a plain HF model directory; PEFT adapters come through lora_merge.PeftOverlay

    def native_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: self.get_native(k) for k in native_keys(self.config)}

    def close(self) -> None:
        self._handles.clear()


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF key -> shape for ``cfg``: the native->HF mapping run on meta tensors."""
    shapes = native_shapes(cfg)
    meta = lambda key: torch.empty(shapes[key], device="meta")  # noqa: E731
    return {k: tuple(t.shape) for k, t in hf_from_native(meta, cfg)}


# ---------------------------------------------------------------- writing


def _header(plan: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> bytes:
    """The 8-byte length + JSON header of a safetensors file holding ``plan`` in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset, size = 0, torch.empty((), dtype=dtype).element_size()
    for name, shape in plan:
        nbytes = size * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": SAFETENSORS_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    path: Path, tensors: Iterable[tuple[str, torch.Tensor]], plan: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype
) -> None:
    """Write one safetensors file whose header is ``plan``, consuming ``tensors`` in the same order."""
    with open(path, "wb") as f:
        f.write(_header(plan, dtype))
        writer = BackgroundWriter(lambda t: f.write(tensor_bytes(t)), name=f"write-{path.name}")
        try:
            for (name, shape), (got, t) in zip(plan, tensors, strict=True):
                if got != name or tuple(t.shape) != tuple(shape):
                    raise RuntimeError(f"writer expected {name} {list(shape)}, got {got} {list(t.shape)}")
                writer.put(t.detach().to(dtype).contiguous())
        finally:
            writer.close()


def copy_safetensors(
    path: Path, segments: Iterable[tuple[str, list[Piece]]], plan: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype
) -> None:
    """Like ``write_safetensors``, but each tensor's bytes are copied from file segments (``fastcopy``)."""
    head = _header(plan, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, head)
        pos = len(head)
        for (name, shape), (got, segs) in zip(plan, segments, strict=True):
            want = size * int(torch.Size(shape).numel())
            if got != name or sum(size_of(seg) for seg in segs) != want:
                raise RuntimeError(f"copy plan for {name} does not cover its {want} bytes")
            pos += copy_segments(fd, pos, segs)
    finally:
        os.close(fd)


def plan_shards(
    entries: list[tuple[str, tuple[int, ...]]], elem_bytes: int, max_shard_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy split in order, as transformers does: start a new shard when the next tensor would overflow."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in entries:
        nbytes = elem_bytes * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def as_getter(source: NativeTensors) -> Getter:
    """A ``get(native_key)`` from a state dict, a callable, or a checkpoint object with ``get_native``."""
    if isinstance(source, Mapping):
        return source.__getitem__
    if callable(source):
        return source
    return source.get_native


def save_hf(
    source: NativeTensors,
    cfg: ModelConfig,
    out_dir: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    hf_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> list[Path]:
    """Write ``cfg``'s model as an HF directory into ``out_dir`` (staged in a temp dir, published at the end).

    ``source`` gives native tensors (dict, ``get(key)`` callable, or an object with ``get_native``); ``dtype``
    defaults to the source's; ``hf_config`` is an original config.json whose extra keys are kept.
    """
    get = as_getter(source)
    dtype = dtype or get(FINAL_NORM).dtype
    entries = list(expected_hf_shapes(cfg).items())
    shards = plan_shards(entries, torch.empty((), dtype=dtype).element_size(), max_shard_bytes)
    out = Path(out_dir)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with staging(out) as tmp:
        if getattr(source, "can_copy", lambda dtype: False)(dtype):
            rows = RowPlan(cast(Any, source).row_source)  # same bytes out as in: copy them
            pieces = ((k, rows.segments(ids)) for k, ids in hf_from_native(rows.get, cfg))
            stream: Iterator[Any] = _reported(pieces, len(entries), progress)
            for name, plan in zip(names, shards, strict=True):
                copy_safetensors(tmp / name, _counted(stream, len(plan)), plan, dtype)
        else:
            stream = _reported(hf_from_native(get, cfg), len(entries), progress)
            for name, plan in zip(names, shards, strict=True):
                write_safetensors(tmp / name, _counted(stream, len(plan)), plan, dtype)
        elem = torch.empty((), dtype=dtype).element_size()
        index = {
            "metadata": {"total_size": sum(elem * int(torch.Size(s).numel()) for _, s in entries)},
            "weight_map": {k: names[i] for i, plan in enumerate(shards) for k, _ in plan},
        }
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = {**(hf_config or {}), **cfg.to_hf(HF_DTYPE_NAMES[dtype])}
        config.pop("dtype", None)  # transformers 5 spelling; one dtype key only
        (tmp / "generation_config.json").write_text(json.dumps(generation_config or QWEN3_GENERATION, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [out / n for n in names]


def _reported(stream: Iterator[tuple[str, Any]], total: int, progress: Progress | None) -> Iterator[tuple[str, Any]]:
    for done, item in enumerate(stream, 1):
        if progress:  # before the yield: the consumer stops pulling after the last tensor
            progress(done, total)
        yield item


def _counted(stream: Iterator[tuple[str, Any]], n: int) -> Iterator[tuple[str, Any]]:
    for _ in range(n):
        yield next(stream)


def copy_tokenizer(src: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer files found in ``src`` (a directory, or a file inside one) into ``out_dir``."""
    src_dir = Path(src) if Path(src).is_dir() else Path(src).parent
    if not src_dir.is_dir():
        raise BadInput(f"{src}: tokenizer directory not found", field="tokenizer_model")
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            tmp = Path(out_dir) / f".{name}.tmp{os.getpid()}"
            shutil.copy2(src_dir / name, tmp)
            os.replace(tmp, Path(out_dir) / name)  # a symlink planted at the name is replaced, never written through
            copied.append(name)
    return copied


class staging:
    """Write into ``<out>/.staging-<pid>/``, then move each file into ``out`` (config/index/tracker files last).

    A failure while writing (a full disk) removes the staging directory and publishes nothing. Everything staged is
    fsynced before the first rename and each rename is synced, so a crash mid-publish never leaves a completion
    marker (index, config, tracker) naming bytes not on disk. A tracker already in ``out`` keeps naming its own
    checkpoint until the new one replaces it in one rename, unless the staged set replaces the directory it names.
    """

    LAST = ("model.safetensors.index.json", "config.json", "latest_checkpointed_iteration.txt")
    TRACKER = "latest_checkpointed_iteration.txt"

    def __init__(self, out: Path, name: str | None = None):
        self.out = out
        self.tmp = out / (name or f".staging-{os.getpid()}")  # a fixed name when several processes write into it

    def __enter__(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:
            fsync_tree(self.tmp)  # a full disk can surface only here (delayed allocation): nothing published yet
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self._drop_stale_markers()
        entries = sorted(self.tmp.iterdir(), key=lambda p: p.name in self.LAST)
        for entry in entries:
            target = self.out / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(entry, target)
            fsync_dir(self.out)
        self.tmp.rmdir()
        fsync_dir(self.out)

    def _drop_stale_markers(self) -> None:
        """Unlink the completion markers the publish is about to make wrong: the index (its shards get replaced one
        by one), and the tracker only when a staged directory replaces one it may name."""
        (self.out / INDEX).unlink(missing_ok=True)
        if (self.tmp / INDEX).exists():  # shards of an earlier conversion would pollute the directory
            for old in self.out.glob("model-?????-of-?????.safetensors"):
                old.unlink()
        if any(e.is_dir() and (self.out / e.name).exists() for e in self.tmp.iterdir()):
            (self.out / self.TRACKER).unlink(missing_ok=True)
