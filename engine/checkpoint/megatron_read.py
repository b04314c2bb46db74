"""Reading Megatron-LM / MindSpeed-LLM legacy ``torch`` checkpoints, sharded by TP, PP and EP.

Layout (``docs/megatron-interop.md`` §1): ``<root>/latest_checkpointed_iteration.txt`` (an integer, or
``release``), ``<root>/iter_{N:07d}/mp_rank_{TT}[_{PPP}]/model_optim_rng.pt``, each a ``torch.save`` dict with
``args`` (an ``argparse.Namespace``), ``checkpoint_version`` 3.0, ``iteration`` and ``model`` (``model0``,
``model1``... per virtual-pipeline chunk) holding that rank's local-spec tensors with stage-local layer numbers.

Reading parses every rank file's pickle only (``engine.checkpoint.reader``) and reads a native tensor's TP pieces
straight into place when asked, merging LoRA adapters per TP shard on the way (W_k + alpha/r · B_k @ A_k in fp32,
MindSpeed's rule). Pickles are read through an allow-list (``engine.checkpoint.safe_pickle``): Megatron's enums in
``args`` load as inert stand-ins, any class a real checkpoint does not hold is refused. The writer is
``engine.checkpoint.megatron_write``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.fastcopy import MergedRows
from engine.checkpoint.layout import (
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    Slot,
    layer_of,
    merge,
    native_shapes,
    pipeline_chunks,
    rank_dir_name,
    shard,
    shard_shape,
    split_rule,
    stored_shape,
    uncut,
)
from engine.checkpoint.reader import MemoryRef, TensorRef, TorchZipFile, read_merged
from engine.checkpoint.safe_pickle import load_torch_file
from engine.contract import rope_scaling
from engine.contract.inspect import _RANK_DIR_RE, resolve_iteration_dir
from engine.contract.model_config import ModelConfig, moe_from_args
from engine.contract.runfiles import BadInput
from engine.model.hf_mapping import EXPERT_FC1, EXPERT_FC2, native_keys
from engine.model.lora import from_mindspeed_keys, merge_lora_rounded

log = logging.getLogger(__name__)

MODEL_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0


def load_rank_file(path: Path, lazy: bool = False) -> dict[str, Any]:
    """One ``model_optim_rng.pt`` as ``torch.load`` gives it (tensors read); with ``lazy`` every tensor is a
    ``TensorRef``/``MemoryRef`` read on demand. Pickles go through the allow-list (``safe_pickle``)."""
    if not path.is_file():
        raise BadInput(f"{path}: missing", field="load_dir")
    if zipfile.is_zipfile(path):
        obj = TorchZipFile(path).obj
    else:
        raw = load_torch_file(path)
        obj = {
            k: (
                {n: MemoryRef(t) if isinstance(t, torch.Tensor) else t for n, t in v.items()}
                if isinstance(v, dict)
                else v
            )
            for k, v in raw.items()
        }
    if lazy:
        return obj
    return {
        k: ({n: t.read() if hasattr(t, "read_rows") else t for n, t in v.items()} if isinstance(v, dict) else v)
        for k, v in obj.items()
    }


# ---------------------------------------------------------------- writing


class _LazyModels(dict):
    """rank -> its file's chunks, each rank file opened (pickle parsed) the first time it is asked for."""

    def __init__(self, files: dict[tuple[int, int, int], Path], opened: list[Path]):
        super().__init__()
        self.files, self.opened = files, opened

    def __missing__(self, rank: tuple[int, int, int]) -> dict[str, dict[str, Any]]:
        if rank not in self.files:
            raise KeyError(rank)
        self.opened.append(self.files[rank])
        value = self[rank] = _chunks(load_rank_file(self.files[rank], lazy=True), self.files[rank])
        return value

    def load_all(self) -> _LazyModels:
        for rank in self.files:
            self[rank]  # noqa: B018 - opens it
        return self

    def items(self):  # noqa: ANN201 - every rank file, opened
        return dict.items(self.load_all())

    def values(self):  # noqa: ANN201
        return dict.values(self.load_all())


class RankFiles:
    """The rank files of one checkpoint directory, addressed by native (global) key.

    Files are opened when a tensor of theirs is asked for; the one opened for ``args`` is ``view``'s own (or the one
    at the same relative place when the layouts differ), else the first. When ``args``
    give the pipeline layout (num_layers, PP, num_layer_list / virtual stages: what Megatron and MindSpeed write),
    layers are located from it and no other file is opened for that; else by counting the layers of every stage.
    ``opened`` lists the files opened so far."""

    def __init__(self, root: str | os.PathLike[str], view: RankView | None = None):
        self.iter_dir, self.iteration = resolve_iteration_dir(root)
        self.tp, self.pp, self.ep, files = _rank_files(self.iter_dir)
        self.opened: list[Path] = []
        first = (0, 0, 0)
        if view is not None:  # the file at the same relative place: the rank's own when the layouts match
            first = (view.tp_rank * self.tp // view.tp, view.pp_rank * self.pp // view.pp, 0)
        if first not in files:
            _check_complete(self.iter_dir, self.tp, self.pp, self.ep, files)
        raw = load_rank_file(files[first], lazy=True)
        self.args = raw.get("args")
        pp = self.pp
        self.pp, self.ep, files = _as_expert_ranks(self.args, self.tp, self.pp, self.ep, files)
        if self.pp != pp:  # the file read is (t, 0, e), not (t, p, 0)
            first = (first[0], 0, first[1])
        _check_complete(self.iter_dir, self.tp, self.pp, self.ep, files)
        self.first = first
        self.models = _LazyModels(files, self.opened)
        self.opened.append(files[first])
        self.models[first] = _chunks(raw, files[first])
        self.num_experts = int(getattr(self.args, "num_experts", None) or 0)
        if self.ep > 1 and (not self.num_experts or self.num_experts % self.ep):
            raise BadInput(
                f"{self.iter_dir}: {self.ep} expert-parallel ranks but args.num_experts is {self.num_experts or None}",
                field="load_dir",
            )
        self.layer_at: list[tuple[int, str, int]] = []  # (stage, chunk name, local index) of every global layer
        self.where: dict[str, tuple[int, str]] = {}  # (stage, chunk name) of the embedding, final norm, head
        if not self._locate_from_args():
            self._locate()

    def _locate_from_args(self) -> bool:
        """Layer and embedding/head locations from ``args`` alone (no file opened); False when args cannot say."""
        a = self.args
        layers, pp = getattr(a, "num_layers", None), getattr(a, "pipeline_model_parallel_size", None)
        if not isinstance(layers, int) or pp != self.pp:
            return False
        raw_list = getattr(a, "num_layer_list", None)
        try:
            items = raw_list.split(",") if isinstance(raw_list, str) else raw_list
            layer_list = [int(x) for x in items] if items else None
            stages = pipeline_chunks(layers, pp, layer_list, getattr(a, "num_layers_per_virtual_pipeline_stage", None))
        except (ValueError, TypeError):
            return False
        self.layer_at = []
        self.where = {}
        for chunks in zip(*stages, strict=True):  # chunk v of every stage comes before chunk v+1
            for chunk in chunks:
                name = "model" if len(stages[chunk.stage]) == 1 else f"model{chunk.index}"
                self.layer_at += [(chunk.stage, name, i) for i in range(len(chunk.layers))]
                if chunk.first:
                    self.where[EMBEDDING] = (chunk.stage, name)
                if chunk.last:
                    self.where[FINAL_NORM] = (chunk.stage, name)
                    tied = not getattr(a, "untie_embeddings_and_output_weights", False)
                    if not tied or pp > 1:
                        self.where[OUTPUT] = (chunk.stage, name)
        return True

    def _locate(self) -> None:
        """Map global layers and the embedding/head to (stage, chunk name, local index)."""
        names = sorted(self.models[(0, 0, 0)], key=lambda n: int(n[5:] or 0))
        counts = {(p, n): _layer_count(self.models[(0, p, 0)].get(n, {})) for p in range(self.pp) for n in names}
        self.layer_at = []
        for n in names:  # with VPP chunk v of every stage comes before chunk v+1
            for p in range(self.pp):
                self.layer_at += [(p, n, i) for i in range(counts[(p, n)])]
        self.where = {}
        for p in range(self.pp):
            for n in names:
                for key in (EMBEDDING, FINAL_NORM, OUTPUT):
                    if key in self.models[(0, p, 0)].get(n, {}):
                        self.where.setdefault(key, (p, n))

    def local(self, key: str) -> tuple[int, str, str]:
        """(stage, chunk name, key as stored) of native ``key``; KeyError when absent."""
        parsed = layer_of(key)
        if parsed is None:
            if key not in self.where:
                raise KeyError(key)
            return (*self.where[key], key)
        layer, suffix = parsed
        if layer >= len(self.layer_at):
            raise KeyError(key)
        p, n, i = self.layer_at[layer]
        return p, n, f"decoder.layers.{i}.{suffix}"

    def has(self, key: str, t: int = 0) -> bool:
        try:
            p, n, local = self.local(key)
        except KeyError:
            return False
        return local in self.models[(t, p, 0)].get(n, {})

    def raw(self, key: str, t: int) -> Any:  # Any: the unpickled reference (TensorRef or MemoryRef), unchecked
        """TP rank ``t``'s stored piece of ``key`` as a lazy reference (``.shape``, ``.read()``)."""
        p, n, local = self.local(key)
        tensors = self.models[(t, p, 0)].get(n, {})
        if local not in tensors:
            raise KeyError(key)
        return tensors[local]

    def full(self, key: str) -> torch.Tensor:
        if self.is_experts(key):
            return merge([self.experts(key, t, 0, self.num_experts) for t in range(self.tp)], split_rule(key))
        refs = [self.raw(key, t) for t in range(self.tp)]
        if len(refs[0].shape) > 2:  # stacked expert LoRA adapters, TP-cut per expert (layout.rule_dim): glued in memory
            return merge([ref.read() for ref in refs], split_rule(key))
        return read_merged(refs, split_rule(key))

    def is_experts(self, key: str) -> bool:
        """True for a stacked native expert tensor, which the files hold per expert or per EP rank block."""
        parsed = layer_of(key)
        return bool(self.num_experts) and parsed is not None and parsed[1] in (EXPERT_FC1, EXPERT_FC2)

    def experts(self, key: str, t: int, lo: int, hi: int) -> torch.Tensor:
        """TP rank ``t``'s piece (n, rows, cols) of experts [lo, hi) of the stacked native ``key``, read from the
        EP ranks' files holding them (SequentialMLP ``local_experts.{i}`` or GroupedMLP ``weight1/2``)."""
        layer, suffix = layer_of(key) or (0, "")
        if layer >= len(self.layer_at):
            raise KeyError(key)
        p, n, i = self.layer_at[layer]
        per = self.num_experts // self.ep
        ranks = range(lo // per, (hi - 1) // per + 1)
        out: torch.Tensor | None = None
        for e in ranks:  # each EP rank's block copied into place: one block in flight, never a second whole copy
            a, b = max(lo, e * per) - e * per, min(hi, (e + 1) * per) - e * per
            block = _expert_block(self.models[(t, p, e)].get(n, {}), i, suffix, a, b, per)
            if len(ranks) == 1:
                return block
            if out is None:
                out = torch.empty((hi - lo, *block.shape[1:]), dtype=block.dtype)
            out[e * per + a - lo : e * per + b - lo] = block
        assert out is not None
        return out

    def lora_modules(self) -> list[str]:
        """Global native module paths that carry adapters, e.g. ``decoder.layers.0.self_attention.linear_qkv``."""
        found = []
        for layer, (p, n, i) in enumerate(self.layer_at):
            prefix = f"decoder.layers.{i}."
            for key in self.models[(0, p, 0)][n]:
                if key.startswith(prefix) and key.endswith(".lora_A.weight"):
                    found.append(f"decoder.layers.{layer}." + key[len(prefix) :].removesuffix(".lora_A.weight"))
        return found

    def rank_file(self, t: int, p: int, e: int = 0) -> Path:
        return self.iter_dir / rank_dir_name(t, p, self.pp, e, self.ep) / MODEL_FILE


def _expert_block(tensors: Mapping[str, Any], i: int, suffix: str, a: int, b: int, per: int) -> torch.Tensor:
    """Local experts [a, b) of stage-local layer ``i`` in one rank file's chunk, stacked (n, rows, cols)."""
    prefix = f"decoder.layers.{i}.mlp.experts."
    fc1 = suffix == EXPERT_FC1
    grouped = tensors.get(prefix + ("weight1" if fc1 else "weight2"))
    if grouped is not None:
        # weight1/2's memory is (per, ...) expert blocks: read rows a..b of that view, then give them the stored form
        block = _as_rows(grouped, per).read_rows(a, b)
        stored = block.reshape(grouped.shape[0], -1) if fc1 else block.reshape(-1, grouped.shape[1])
        return uncut(Slot("", suffix, (a, b), True), stored)
    name = "linear_fc1.weight" if fc1 else "linear_fc2.weight"
    names = [f"{prefix}local_experts.{j}.{name}" for j in range(a, b)]
    if any(n not in tensors for n in names):
        raise KeyError(f"decoder.layers.{i}.{suffix}")
    return torch.stack([tensors[n].read() for n in names])


def _as_rows(ref: TensorRef | MemoryRef, rows: int) -> TensorRef | MemoryRef:
    """``ref`` seen as ``rows`` equal rows (a contiguous tensor's bytes, reshaped)."""
    numel = int(torch.Size(ref.shape).numel())
    if isinstance(ref, TensorRef):
        return TensorRef(ref.file, ref.name, ref.offset, (rows, numel // rows), ref.dtype)
    return MemoryRef(ref.read().reshape(rows, -1))


class MegatronCheckpoint:
    """A Megatron legacy checkpoint opened lazily; ``get_native(key)`` gives full TP1 tensors.

    ``lora_dir``: MindSpeed's ``--lora-load`` checkpoint whose tensors override the base (same TP/PP: per rank, as
    MindSpeed; another layout, e.g. our trainer's TP1 adapters-only save: re-cut to the base's shards). LoRA
    adapters found in either are merged when ``lora_alpha``/``lora_r`` are known (flags, else checkpoint args).
    ``hf_config``: an HF config.json dict for what the tensors cannot tell (epsilon, RoPE base, true vocab size).
    ``field``: the spec field that named ``root`` (load_dir for convert, load for eval and serve), for messages.
    """

    merge_rounding = "fp32"  # engine.model.lora.MERGE_ROUNDINGS; the convert job sets spec.lora_merge_rounding

    def __init__(
        self,
        root: str | os.PathLike[str],
        lora_dir: str | os.PathLike[str] | None = None,
        lora_alpha: float | None = None,
        lora_r: int | None = None,
        hf_config: Mapping[str, Any] | None = None,
        view: RankView | None = None,
        field: str = "load_dir",
    ):
        self.root = Path(root)
        self.view = view
        self.base = RankFiles(root, view)
        self.iter_dir, self.iteration, self.tp, self.pp = (
            self.base.iter_dir,
            self.base.iteration,
            self.base.tp,
            self.base.pp,
        )
        self.args = self.base.args
        self.side: RankFiles | None = None
        arg_sources = [self.args]
        if lora_dir is not None:
            lora = RankFiles(lora_dir)
            arg_sources.insert(0, lora.args)
            if (lora.tp, lora.pp, lora.ep) == (self.tp, self.pp, 1):  # adapters into the (EP rank 0) files
                for rank, chunks in lora.models.items():
                    for name, tensors in chunks.items():
                        self.base.models[rank].setdefault(name, {}).update(tensors)
            else:
                self.side = lora
        self.lora_alpha = lora_alpha if lora_alpha is not None else _first_attr(arg_sources, "lora_alpha")
        self.lora_r = lora_r if lora_r is not None else _first_attr(arg_sources, "lora_r")
        opened = self.base.models[self.base.first]  # the one file read so far: enough to tell an adapters-only save
        names = [k for t in opened.values() for k in t if not k.endswith("_extra_state")]
        if names and all("lora" in k for k in names):  # a --lora-ckpt-filter checkpoint given as the base
            raise BadInput(
                f"{field}: {self.root} holds only LoRA adapters; give the base model as {field} and the adapters as "
                "lora_load",
                field=field,
            )
        for key in (EMBEDDING, FINAL_NORM):
            if key not in self.base.where:
                raise BadInput(f"{self.iter_dir}: no rank holds {key}", field="load_dir")
        self.config = self._infer_config(dict(hf_config or {}))
        self._validate()

    # -- config

    def _infer_config(self, hf: dict[str, Any]) -> ModelConfig:
        """Shapes from the tensors (they cannot lie); epsilon, RoPE base and tying from args or config.json."""
        a, tp = self.args, self.tp
        t, layer = self._probe()
        shape = lambda key: tuple(self.base.raw(key, t).shape)  # noqa: E731
        pre = f"decoder.layers.{layer}."
        try:
            d = shape(pre + "self_attention.q_layernorm.weight")[0]
            heads = shape(pre + "self_attention.linear_proj.weight")[1] * tp // d
            groups = (shape(pre + "self_attention.linear_qkv.weight")[0] * tp // d - heads) // 2
            moe = moe_from_args(a, len(self.base.layer_at))
            freq = moe.get("moe_layer_freq")
            if moe and (freq == 1 or isinstance(freq, tuple) and freq[layer]):  # the probed layer is MoE
                ffn = int(getattr(a, "ffn_hidden_size", 0) or moe["moe_ffn_hidden_size"])
            else:
                ffn = shape(pre + "mlp.linear_fc1.weight")[0] * tp // 2
        except KeyError as err:
            raise BadInput(
                f"{self.base.rank_file(t, self.base.layer_at[layer][0])}: tensor {err.args[0]} is "
                f"missing: not a Qwen3 "
                f"(local spec, qk-layernorm) checkpoint",
                field="load_dir",
            ) from None
        hidden = shape(pre + "input_layernorm.weight")[0]
        rows = self._padded_rows() // tp
        untie = getattr(a, "untie_embeddings_and_output_weights", None)
        tied = (not untie) if untie is not None else hf.get("tie_word_embeddings", self._output_is_embedding())
        vocab = rows * tp
        if hf.get("vocab_size") and hf["vocab_size"] < vocab:
            vocab = hf["vocab_size"]  # Megatron padded the vocabulary; the HF model has the true size
        try:
            ref: ModelConfig | None = ModelConfig.from_hf(hf) if hf else None
        except (KeyError, ValueError, TypeError):
            ref = None
        # args first (the run's own values), then config.json, then Qwen3's published values
        pick = lambda arg, default: getattr(a, arg, None) or (getattr(ref, arg) if ref else None) or default  # noqa: E731
        cfg = ModelConfig(
            num_layers=len(self.base.layer_at),
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            num_attention_heads=heads,
            num_query_groups=groups,
            kv_channels=d,
            vocab_size=vocab,
            tie_word_embeddings=bool(tied),
            norm_epsilon=float(pick("norm_epsilon", 1e-6)),
            rotary_base=float(pick("rotary_base", 1e6)),
            max_position_embeddings=int(pick("max_position_embeddings", 40960)),
            init_method_std=float(pick("init_method_std", 0.02)),
            **moe,
            **(rope_scaling.from_args(a) or _rope_of(ref)),
        )
        for field in ("num_layers", "hidden_size", "num_attention_heads"):
            if getattr(a, field, None) not in (None, getattr(cfg, field)):
                raise BadInput(
                    f"{self.iter_dir}: args.{field} is {getattr(a, field)} but the tensors hold "
                    f"{getattr(cfg, field)} (missing or mixed rank files?)",
                    field="load_dir",
                )
        return cfg

    def _output_is_embedding(self) -> bool:
        if OUTPUT not in self.base.where:
            return True  # PP=1 tied checkpoints carry no output layer
        return all(
            torch.equal(self.base.raw(OUTPUT, t).read(), self.base.raw(EMBEDDING, t).read()) for t in range(self.tp)
        )

    def _probe(self) -> tuple[int, int]:
        """(TP rank, global layer) whose tensors tell the shapes: the first layer of the file already open."""
        if not self.base.layer_at:
            raise BadInput(f"{self.iter_dir}: the checkpoint holds no decoder layers", field="load_dir")
        t, p, _ = self.base.first
        layer = next((i for i, (stage, _, _) in enumerate(self.base.layer_at) if stage == p), 0)
        return (t, layer) if self.base.layer_at[layer][0] == p else (0, 0)

    def _read_keys(self) -> tuple[list[str], range]:
        """(native keys, TP ranks) this process will read: a rank's own (``view``), else every tensor."""
        if self.view is None:
            return native_keys(self.config), range(self.tp)
        keys = self.view.keys(self.config)
        if self.view.tp == self.tp:  # the rank reads its own TP piece as stored
            return keys, range(self.view.tp_rank, self.view.tp_rank + 1)
        return keys, range(self.tp)

    def _validate(self) -> None:
        cfg = self.config
        full = native_shapes(cfg.replace(vocab_size=self._padded_rows()))
        keys, tp_ranks = self._read_keys()
        for key in keys:
            if key == OUTPUT and cfg.tie_word_embeddings and OUTPUT not in self.base.where:
                continue  # read from the embedding
            if self.base.is_experts(key):
                self._validate_experts(key, full[key], tp_ranks)
                continue
            want = shard_shape(full[key if key in full else EMBEDDING], split_rule(key), self.tp)
            try:
                p: int | None = self.base.local(key)[0]
            except KeyError:
                p = None
            for t in tp_ranks:
                where = self.base.rank_file(t, p) if p is not None else self.iter_dir
                try:
                    got = self.base.raw(key, t)
                except KeyError:
                    raise BadInput(f"{where}: tensor {key} (global name) is missing", field="load_dir") from None
                if tuple(got.shape) != want:
                    raise BadInput(
                        f"{where}: tensor {self.base.local(key)[2]} has shape {list(got.shape)}, expected {list(want)}",
                        field="load_dir",
                    )

    def _validate_experts(self, key: str, shape: tuple[int, ...], tp_ranks: range) -> None:
        """Every EP rank's tensors of stacked ``key``: GroupedMLP ``weight1/2`` or each local expert, right shapes."""
        per = self.base.num_experts // self.base.ep
        for t in tp_ranks:
            for e in range(self.base.ep):
                p, n, local = self.base.local(key)
                tensors = self.base.models[(t, p, e)].get(n, {})
                prefix = local.removesuffix(layer_of(key)[1]) + "mlp.experts."  # type: ignore[index]
                fc1 = key.endswith(EXPERT_FC1)
                grouped = prefix + ("weight1" if fc1 else "weight2")
                if grouped in tensors:
                    wanted = [(grouped, Slot(grouped, key, (0, per), True))]
                else:
                    name = "linear_fc1.weight" if fc1 else "linear_fc2.weight"
                    wanted = [(f"{prefix}local_experts.{j}.{name}", Slot("", key, (j, j + 1))) for j in range(per)]
                for name, slot in wanted:
                    where = self.base.rank_file(t, p, e)
                    if name not in tensors:
                        raise BadInput(
                            f"{where}: tensor {name} is missing ({per} local experts expected)", field="load_dir"
                        )
                    want, got = stored_shape(slot, shape, self.tp), tuple(tensors[name].shape)
                    if got != want:
                        raise BadInput(
                            f"{where}: tensor {name} has shape {list(got)}, expected {list(want)}", field="load_dir"
                        )

    def _padded_rows(self) -> int:
        padded = getattr(self.args, "padded_vocab_size", None)
        if self.view is not None and isinstance(padded, int) and padded % self.tp == 0:
            return padded  # a rank of another stage need not open the first stage's file for this
        return self.base.raw(EMBEDDING, 0).shape[0] * self.tp

    # -- tensors

    def get_shard(self, key: str, tp: int, rank: int) -> torch.Tensor:
        """Native ``key``'s piece for TP rank ``rank`` of ``tp``; LoRA merged, vocabulary padding dropped."""
        if key == OUTPUT and self.config.tie_word_embeddings and not (tp == self.tp and OUTPUT in self.base.where):
            key = EMBEDDING  # a pipeline last stage's copy of the tied embedding (stored there with PP > 1)
        trimmed = key in (EMBEDDING, OUTPUT) and self.config.vocab_size != self._padded_rows()
        if tp == self.tp and not trimmed:
            return self._stored(key, rank)
        return shard(self.get_native(key), split_rule(key), tp, rank)

    get_native_shard = get_shard

    def get_native(self, key: str) -> torch.Tensor:
        if key == OUTPUT and self.config.tie_word_embeddings:
            key = EMBEDDING
        if self._adapted(key):
            full = merge([self._stored(key, t) for t in range(self.tp)], split_rule(key))
        else:
            source = self.side if self.side is not None and self.side.has(key) else self.base
            full = source.full(key)
        if key in (EMBEDDING, OUTPUT):
            full = full[: self.config.vocab_size]
        return full

    def _adapted(self, key: str) -> bool:
        a_key = key.removesuffix(".weight") + ".lora_A.weight"
        return self.base.has(a_key) or (self.side is not None and self.side.has(a_key))

    def opened_files(self) -> list[Path]:
        """Rank files opened so far (pickle parsed), in order."""
        return list(self.base.opened)

    def get_experts(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Experts [lo, hi) of the stacked native ``key`` (full TP1 width), reading only the files holding them."""
        if self._adapted(key) or (self.side is not None and self.side.has(key)):
            return self.get_native(key)[lo:hi]
        return merge([self.base.experts(key, t, lo, hi) for t in range(self.tp)], split_rule(key))

    def _stored(self, key: str, t: int) -> torch.Tensor:
        """TP rank ``t``'s piece of ``key`` as this checkpoint is cut, with its LoRA adapters merged in."""
        if self.side is not None and self.side.has(key):
            weight = shard(self.side.full(key), split_rule(key), self.tp, t)
        elif self.base.is_experts(key):
            weight = self.base.experts(key, t, 0, self.base.num_experts)
        else:
            weight = self.base.raw(key, t).read()
        module = key.removesuffix(".weight")
        a_key, b_key = module + ".lora_A.weight", module + ".lora_B.weight"
        if self.base.has(a_key, t) and self.base.has(b_key, t):
            a, b = self.base.raw(a_key, t).read(), self.base.raw(b_key, t).read()
        elif self.side is not None and self.side.has(a_key) and self.side.has(b_key):
            a = shard(self.side.full(a_key), split_rule(a_key), self.tp, t)
            b = shard(self.side.full(b_key), split_rule(b_key), self.tp, t)
        else:
            return weight
        if self.lora_alpha is None or self.lora_r is None:
            raise BadInput(
                f"{self.iter_dir}: {key} has LoRA adapters; give lora_r and lora_alpha to merge them", field="lora_r"
            )
        return merge_lora_rounded(weight, a, b, self.lora_alpha, self.lora_r, self.merge_rounding)

    def can_copy(self, dtype: torch.dtype) -> bool:
        """True when HF output is the stored bytes rearranged: same dtype everywhere, nothing to merge."""
        if self.side is not None or self.lora_modules() or self.base.num_experts:
            return False  # (MoE: experts are stored per expert or transposed per EP block, not as native rows)
        return all(
            isinstance(ref, TensorRef) and ref.dtype == dtype
            for chunks in self.base.models.values()
            for tensors in chunks.values()
            for ref in tensors.values()
        )

    def row_source(self, key: str) -> MergedRows:
        """Where the rows of native ``key`` lie in the rank files (for ``fastcopy.RowPlan``)."""
        if key == OUTPUT and self.config.tie_word_embeddings:
            key = EMBEDDING
        rows = self.config.vocab_size if key in (EMBEDDING, OUTPUT) else None
        return MergedRows([self.base.raw(key, t) for t in range(self.tp)], split_rule(key), rows)

    def lora_modules(self) -> list[str]:
        found = self.base.lora_modules() + (self.side.lora_modules() if self.side else [])
        return list(dict.fromkeys(found))

    def lora_tensor(self, key: str) -> torch.Tensor:
        """A full (TP-merged) LoRA tensor, e.g. ``decoder.layers.3.mlp.linear_fc1.lora_B.weight``."""
        if self.base.has(key) or self.side is None:
            return self.base.full(key)
        return self.side.full(key)


@dataclasses.dataclass(frozen=True)
class RankView:
    """What one training rank reads: TP rank ``tp_rank`` of ``tp`` and PP rank ``pp_rank``; ``keys(cfg)`` its native
    keys. When the checkpoint is cut the same way, the rank opens exactly its own ``mp_rank_TT_PPP`` file; else the
    files holding its keys (all TP pieces of them, re-sliced)."""

    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    keys: Callable[[ModelConfig], list[str]]


def _first_attr(objs: list[object], name: str) -> Any:  # Any: a Megatron argument's value, of any flag's type
    for obj in objs:
        if getattr(obj, name, None) is not None:
            return getattr(obj, name)
    return None


def _rank_files(iter_dir: Path) -> tuple[int, int, int, dict[tuple[int, int, int], Path]]:
    """(TP, PP, EP, (tp, pp, ep) rank -> its model file) of an iteration directory (``layout.rank_dir_name``).
    ``mp_rank_TT_XXX`` is read as a PP rank here; ``_as_expert_ranks`` re-reads it as an EP rank when args say so."""
    found: dict[tuple[int, int, int], Path] = {}
    for entry in iter_dir.iterdir():
        m = _RANK_DIR_RE.match(entry.name)
        if m:
            found[(int(m[1]), int(m[2] or 0), int(m[3] or 0))] = entry / MODEL_FILE
    if not found:
        raise BadInput(f"{iter_dir}: no mp_rank_* directories", field="load_dir")
    return *(max(rank[i] for rank in found) + 1 for i in range(3)), found  # type: ignore[return-value]


def _as_expert_ranks(
    args: object, tp: int, pp: int, ep: int, files: dict[tuple[int, int, int], Path]
) -> tuple[int, int, dict[tuple[int, int, int], Path]]:
    """(PP, EP, files) with ``mp_rank_TT_XXX`` taken as EP ranks when ``args`` say PP 1 and EP = the XXX count
    (Megatron's ``get_checkpoint_name`` gives PP > 1 and EP > 1 the same two-part name)."""
    says_ep = getattr(args, "expert_model_parallel_size", 1) == pp
    if ep == 1 and pp > 1 and says_ep and getattr(args, "pipeline_model_parallel_size", 1) in (1, None):
        return 1, pp, {(t, 0, p): path for (t, p, _), path in files.items()}
    return pp, ep, files


def _check_complete(iter_dir: Path, tp: int, pp: int, ep: int, files: Mapping[tuple[int, int, int], Path]) -> None:
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                if (t, p, e) not in files:
                    raise BadInput(
                        f"{iter_dir / rank_dir_name(t, p, pp, e, ep)}: missing "
                        f"(TP {tp} × PP {pp} × EP {ep} ranks expected)",
                        field="load_dir",
                    )


def _chunks(raw: Mapping[str, Any], path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``model``/``model{v}`` -> tensors with MindSpeed's PEFT names normalised and ``_extra_state`` dropped."""
    names = [k for k in raw if k == "model" or re.fullmatch(r"model\d+", k)]
    if not names:
        raise BadInput(f"{path}: no 'model' entry (keys: {', '.join(map(str, raw))})", field="load_dir")
    return {n: from_mindspeed_keys({k: v for k, v in raw[n].items() if hasattr(v, "read_rows")}) for n in names}


def _layer_count(tensors: Mapping[str, torch.Tensor]) -> int:
    layers = {p[0] for p in map(layer_of, tensors) if p is not None}
    return max(layers) + 1 if layers else 0


def _rope_of(ref: ModelConfig | None) -> dict[str, Any]:
    """The rope-scaling fields of the checkpoint's config.json, when its args carry none (another writer's)."""
    return {field: getattr(ref, field) for field in rope_scaling.FIELDS} if ref and ref.rope_scaling_type else {}
