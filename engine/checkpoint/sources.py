"""Where a rank's weights come from: one typed protocol for every reader, and the seeded initial weights.

``WeightSource`` is what the HF (``hf.HFCheckpoint``), Megatron (``megatron_read.MegatronCheckpoint``), training-checkpoint
(``dcp.DcpWeights``) and PEFT / LoRA overlay (``lora_merge.PeftOverlay`` / ``LoraOverlay``) readers implement: the
model's config, a full native tensor, one TP rank's piece of it, and the LoRA modules it carries. Readers that can
name file byte ranges for conversion's copy path also implement ``ByteRanges`` (HF) or ``RowSources`` (mcore).
Training, eval and ``convert`` read through these; ``engine.checkpoint.sharded`` fills a meta-built, parallelized
model from one.

``TensorDict`` serves small in-memory tensors (LoRA adapters, the base overrides an adapter checkpoint carries) over
an optional fallback source.

``SeededInit`` / ``SeededLoraInit`` are weight sources too: the values ``Qwen3Model.init_weights(seed)`` and
``apply_lora(seed=...)`` give the *full* model, served one TP piece at a time. Both walk one CPU generator over the
full model's parameters in order (as the full build does), so a rank skips what it does not hold by drawing and
dropping it, a bounded chunk at a time: the same numbers for any layout, and never a full-model tensor in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import torch

from engine.checkpoint.fastcopy import Segment
from engine.checkpoint.layout import EMBEDDING, OUTPUT, native_shapes, shard, shard_shape, split_rule
from engine.contract.model_config import ModelConfig
from engine.model.hf_mapping import native_keys
from engine.model.qwen3 import init_std

_CHUNK_ELEMS = 1 << 22  # numbers drawn per step while walking the generator (16 MiB of fp32)


@runtime_checkable
class WeightSource(Protocol):
    """Native (Megatron TP1, global layer numbers) tensors of one model."""

    config: ModelConfig

    def get_native(self, key: str) -> torch.Tensor:
        """The full native tensor ``key``."""
        ...

    def get_native_shard(self, key: str, tp: int, rank: int) -> torch.Tensor:
        """TP rank ``rank`` of ``tp``'s piece of ``key`` (``layout.split_rule``), reading no more than it needs."""
        ...

    def lora_modules(self) -> list[str]:
        """Native module paths that carry LoRA adapters (``decoder.layers.3.mlp.linear_fc1``); [] when none."""
        ...


@runtime_checkable
class ByteRanges(Protocol):
    """A source whose TP pieces are, when no value changes, file byte ranges (conversion copies them as they are)."""

    def shard_segments(self, key: str, tp: int, rank: int, dtype: torch.dtype) -> list[Segment] | None: ...


@runtime_checkable
class ExpertRanges(Protocol):
    """A source that reads a range of experts (dim-0 rows of a stacked expert tensor) alone."""

    def get_experts(self, key: str, lo: int, hi: int) -> torch.Tensor: ...


# What a conversion or a load reads native tensors from: a state dict, a ``get(key)`` callable or a checkpoint reader
NativeTensors = Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor] | WeightSource


def expert_range(source: NativeTensors, key: str, lo: int, hi: int) -> torch.Tensor:
    """Experts [lo, hi) of the stacked native ``key``: read alone where the source can (``get_experts``: HF files,
    mcore rank files, the seeded init), so one SequentialMLP expert or one expert-parallel rank's block never costs
    the whole layer's experts; else cut from the whole tensor (a state dict, a getter, ``get_native``)."""
    if isinstance(source, ExpertRanges):
        return source.get_experts(key, lo, hi)
    if isinstance(source, Mapping):
        return source[key][lo:hi]
    if callable(source):
        return source(key)[lo:hi]
    return source.get_native(key)[lo:hi]


def _tp_rows(shape: tuple[int, ...], key: str, tp: int, rank: int) -> torch.Tensor:
    """Global row numbers (rows: every dim but the last, flattened) of TP rank ``rank``'s rows of ``key``, in local
    order (dim-0 / glu / replicated; per expert for stacked experts)."""
    rows = torch.arange(int(torch.Size(shape[:-1]).numel())).view(*shape[:-1], 1)
    return shard(rows, split_rule(key), tp, rank).reshape(-1)


def _draw_into(
    out: torch.Tensor | None,
    shape: tuple[int, ...],
    key: str,
    tp: int,
    rank: int,
    draw: Callable[[torch.Tensor], object],
    keep: torch.Tensor | None = None,
) -> None:
    """Draw the full tensor of ``shape`` chunk by chunk with ``draw`` (in place); keep TP rank ``rank``'s part in
    ``out`` (None: draw and drop), or the dim-0 rows ``keep`` (ascending; an expert-parallel rank's experts) when
    given. Chunks are whole rows of a multiple of 16 numbers: ``normal_`` then draws the very same sequence as on
    the whole tensor (it fills and transforms in blocks of 16, the tail last). Without ``keep`` a row is the last
    dim (a 1-D tensor: one number per row), so a per-expert TP cut is a set of rows or of columns; with ``keep`` a
    row is one dim-0 slice (one expert)."""
    if keep is not None:
        rows, cols = shape[0], int(torch.Size(shape[1:]).numel())
    else:
        cols = shape[-1] if len(shape) > 1 else 1
        rows = int(torch.Size(shape).numel()) // max(cols, 1)
    step = max(16, (_CHUNK_ELEMS // max(cols, 1)) // 16 * 16)
    starts = list(range(0, rows, step))
    if len(starts) > 1 and (rows - starts[-1]) * cols < 16:
        starts.pop()  # a tail under 16 numbers would take another path: draw it with the chunk before
    bounds = list(zip(starts, starts[1:] + [rows], strict=True))
    rule = split_rule(key)
    column_cut = keep is None and rule == "dim1" and len(shape) > 1
    ids = keep
    if ids is None and not column_cut and out is not None:
        ids = _tp_rows(shape if len(shape) > 1 else (rows, 1), key, tp, rank)
    width = cols // tp if column_cut else cols
    scratch = torch.empty(min(step + 16, rows) * cols) if len(bounds) > 1 else torch.empty(rows * cols)
    for a, b in bounds:
        chunk = scratch[: (b - a) * cols].view(b - a, cols)
        draw(chunk)
        if out is None:
            continue
        flat = out.view(-1, width)
        if ids is None:  # row-parallel: every row, this rank's columns
            flat[a:b] = chunk[:, rank * width : (rank + 1) * width]
        else:
            mine = (ids >= a) & (ids < b)
            flat[mine] = chunk[ids[mine] - a]


class SeededInit:
    """``Qwen3Model(cfg).init_weights(seed)``'s values as a weight source (CPU, fp32), any TP piece of any key.

    Keys are asked for in model order by a rank (its stages in order, each in parameter order); asking for an
    earlier key (a tied head's copy of the embedding) starts the generator over."""

    def __init__(self, cfg: ModelConfig, seed: int | None):
        self.config, self.seed = cfg, seed
        self.order = native_keys(cfg)
        self.shapes = native_shapes(cfg)
        self._restart()

    def _restart(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        self.next = 0  # index in self.order of the next key the generator would draw

    def get_native(self, key: str) -> torch.Tensor:
        return self.get_native_shard(key, 1, 0)

    def get_native_shard(self, key: str, tp: int, rank: int) -> torch.Tensor:
        return self._draw(key, tp, rank, None)

    def get_experts(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self._draw(key, 1, 0, torch.arange(lo, hi))

    def _draw(self, key: str, tp: int, rank: int, keep: torch.Tensor | None) -> torch.Tensor:
        """TP rank ``rank``'s piece of ``key``, or the dim-0 rows ``keep`` of the whole tensor."""
        if key == OUTPUT and self.config.tie_word_embeddings:
            key = EMBEDDING  # a pipeline last stage's copy of the tied embedding
        shape = self.shapes[key]
        std = init_std(key, len(shape), self.config)
        out_shape = shard_shape(shape, split_rule(key), tp)
        if keep is not None:
            out_shape = (keep.numel(), *shape[1:])
        if std is None:
            return torch.ones(out_shape)
        index = self.order.index(key)
        if index < self.next:
            self._restart()
        for skipped in self.order[self.next : index]:
            skip_std = init_std(skipped, len(self.shapes[skipped]), self.config)
            if skip_std is not None:
                _draw_into(None, self.shapes[skipped], skipped, tp, rank, self._normal(skip_std))
        out = torch.empty(out_shape)
        _draw_into(out, shape, key, tp, rank, self._normal(std), keep)
        self.next = index + 1
        return out

    def _normal(self, std: float) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: torch.nn.init.normal_(t, 0.0, std, generator=self.gen)

    def lora_modules(self) -> list[str]:
        return []


class SeededLoraInit:
    """``apply_lora(model, r, ..., seed=seed)``'s adapter values on the full model as a weight source: A ~ U(±1/√in)
    drawn from one generator over the adapted modules in model order, B = 0."""

    def __init__(self, cfg: ModelConfig, modules: list[str], r: int, seed: int | None):
        self.config, self.r, self.seed = cfg, r, seed
        self.modules = modules  # native module paths in the full model's order
        self.shapes = native_shapes(cfg)
        self._restart()

    def _restart(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        self.next = 0

    def get_native(self, key: str) -> torch.Tensor:
        return self.get_native_shard(key, 1, 0)

    def get_native_shard(self, key: str, tp: int, rank: int) -> torch.Tensor:
        module, _, which = key.removesuffix(".weight").rpartition(".lora_")
        *experts, out_rows, _ = self.shapes[module + ".weight"]  # stacked MoE experts: one adapter per expert
        if which == "B":
            full = torch.zeros(*experts, out_rows, self.r)
            return shard(full, split_rule(key), tp, rank)
        index = self.modules.index(module)
        if index < self.next:
            self._restart()
        for skipped in self.modules[self.next : index]:
            self._uniform(self.shapes[skipped + ".weight"])
        self.next = index + 1
        return shard(self._uniform(self.shapes[module + ".weight"]), split_rule(key), tp, rank).contiguous()

    def _uniform(self, weight_shape: tuple[int, ...]) -> torch.Tensor:
        """A of a weight of ``weight_shape`` ((out, in), or (E, out, in) for stacked experts: drawn in one go)."""
        *experts, _, in_features = weight_shape
        bound = 1.0 / math.sqrt(in_features)  # nn.Linear's default (kaiming-uniform, a=sqrt(5)), as PEFT
        return torch.empty(*experts, self.r, in_features).uniform_(-bound, bound, generator=self.gen)

    def lora_modules(self) -> list[str]:
        return list(self.modules)


class TensorDict:
    """Native tensors held in memory (adapters: small), cut per TP rank like a checkpoint's, over ``fallback`` for
    every key they lack (None: a missing key is a KeyError)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], fallback: WeightSource | None = None):
        self.config, self.tensors, self.fallback = config, tensors, fallback

    def get_native(self, key: str) -> torch.Tensor:
        return self.get_native_shard(key, 1, 0)

    def get_native_shard(self, key: str, tp: int, rank: int) -> torch.Tensor:
        if key in self.tensors:
            return shard(self.tensors[key], split_rule(key), tp, rank)
        if self.fallback is None:
            raise KeyError(key)
        return self.fallback.get_native_shard(key, tp, rank)

    def lora_modules(self) -> list[str]:
        return sorted({key.split(".lora_")[0] for key in self.tensors if ".lora_" in key})
