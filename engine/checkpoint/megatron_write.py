"""Writing Megatron-LM / MindSpeed-LLM legacy ``torch`` checkpoints, sharded by TP, PP and EP
(``docs/megatron-interop.md`` §1; the layout is read back by ``engine.checkpoint.megatron_read``).

``save_mcore`` streams each rank file tensor by tensor (``engine.checkpoint.torchfile``: the pickle first from shapes,
then the bytes), so peak memory stays around one tensor whatever the shard size; ``build_args`` writes the
``args`` Namespace MindSpeed's loaders and Megatron-Core read; ``rank_file_plan`` says which tensors each rank file
holds (shared with the trainer's Megatron export).
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.hf import as_getter, staging
from engine.checkpoint.layout import (
    FINAL_NORM,
    Chunk,
    Slot,
    chunk_slots,
    cut,
    native_shapes,
    pipeline_chunks,
    rank_dir_name,
    shard,
    split_rule,
    stored_shape,
)
from engine.checkpoint.megatron_read import CHECKPOINT_VERSION, MODEL_FILE

Progress = Callable[[int, int], None]
from engine.checkpoint.sources import NativeTensors, WeightSource, expert_range
from engine.checkpoint.torchfile import LazyTensor, TorchFileWriter
from engine.contract import layout, rope_scaling
from engine.contract.inspect import TRACKER, iteration_dir_name
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput
from engine.dtypes import DTYPE_NAMES

CONVERT_SEQ_LENGTH = 4096  # what MindSpeed's converter writes for qwen3 (configs/checkpoint/model_cfg.json)


def build_args(
    cfg: ModelConfig,
    tp: int,
    pp: int,
    dtype: torch.dtype,
    num_layer_list: list[int] | None = None,
    vpp_layers: int | None = None,
    hf_config: Mapping[str, Any] | None = None,
    seq_length: int | None = None,
    ep: int = 1,
    grouped: bool = False,
) -> argparse.Namespace:
    """The ``args`` Megatron's and MindSpeed's loaders read (docs/megatron-interop.md gotchas 1-3).

    ``hf_config``: the source's config.json, whose plain attributes are carried as they are (MindSpeed v2's
    ``convert_hf2mg.py::__parameter_packaging``); without it they are rebuilt from ``cfg``. ``seq_length``: the
    training length when known (a trainer save), else MindSpeed's converter value ``CONVERT_SEQ_LENGTH``, never
    ``max_position_embeddings``."""
    hf = {k: v for k, v in (hf_config or cfg.to_hf()).items() if isinstance(v, (int, float, str, bool, list))}
    dtype_name = DTYPE_NAMES[dtype]
    return argparse.Namespace(
        **{
            **hf,  # MindSpeed v2 keeps every plain HF config attribute (num_key_value_heads, head_dim, rope_theta...)
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "ffn_hidden_size": cfg.ffn_hidden_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups,
            # Never False here: with --use-checkpoint-args it would silently turn GQA off (gotcha 3).
            "group_query_attention": True,
            "num_query_groups": cfg.num_query_groups,
            "kv_channels": cfg.kv_channels,
            "qk_layernorm": True,
            "qkv_type": "unpack",
            "add_qkv_bias": False,
            "add_bias_linear": False,
            "swiglu": True,
            "normalization": "RMSNorm",
            "norm_epsilon": cfg.norm_epsilon,
            "position_embedding_type": "rope",
            "use_rotary_position_embeddings": True,
            "rotary_base": cfg.rotary_base,
            # Megatron's check_checkpoint_args compares this with the run's value, True unless --no-position-embedding.
            "add_position_embedding": True,
            "max_position_embeddings": cfg.max_position_embeddings,
            **{field: getattr(cfg, field) for field in rope_scaling.FIELDS},  # MindSpeed's --rope-scaling-* names
            "seq_length": seq_length or CONVERT_SEQ_LENGTH,
            "padded_vocab_size": cfg.vocab_size,
            "make_vocab_size_divisible_by": 1,
            "untie_embeddings_and_output_weights": not cfg.tie_word_embeddings,
            "num_layer_list": ",".join(map(str, num_layer_list)) if num_layer_list else None,  # MindSpeed: a str flag
            "num_layers_per_virtual_pipeline_stage": vpp_layers,
            "init_method_std": cfg.init_method_std,
            "params_dtype": dtype,
            "bf16": dtype == torch.bfloat16,
            "fp16": dtype == torch.float16,
            "tokenizer_type": "PretrainedFromHF",
            "model_type_hf": "qwen3",
            "use_mcore_models": True,
            "transformer_impl": "local",
            "consumed_train_samples": 0,
            "consumed_valid_samples": 0,
            "skipped_train_samples": 0,
            "params_dtype_name": dtype_name,
            "expert_model_parallel_size": ep,
            **(_moe_args(cfg, grouped) if cfg.is_moe else {}),
        }
    )


def _moe_args(cfg: ModelConfig, grouped: bool) -> dict[str, Any]:
    """Megatron's MoE args (and MindSpeed v2's qwen3-moe converter values, configs/checkpoint/model_cfg.json)."""
    freq = cfg.moe_layer_freq
    return {
        "model_type_hf": "qwen3-moe",
        "num_experts": cfg.num_experts,
        "moe_ffn_hidden_size": cfg.expert_ffn_hidden_size,
        "moe_intermediate_size": cfg.expert_ffn_hidden_size,
        "moe_router_topk": cfg.moe_router_topk,
        "num_experts_per_tok": cfg.moe_router_topk,
        "moe_grouped_gemm": grouped,
        # Megatron: an int k (every k-th layer) or a per-layer 0/1 list (MindSpeed passes it as "[1,0,...]")
        "moe_layer_freq": list(freq) if isinstance(freq, tuple) else freq,
        "first_k_dense_replace": 0 if cfg.is_moe_layer(0) else next(iter(cfg.moe_layers), cfg.num_layers),
        "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff,
        "mlp_experts_flag": True,
        "expert_tensor_parallel_size": None,
        "moe_tp_extend_ep": False,
    }


def _shard_getter(source: NativeTensors) -> Callable[[str, int, int], torch.Tensor]:
    """``(native_key, tp, rank) -> shard``: sources that can read one rank's piece directly do so."""
    if isinstance(source, WeightSource):
        return source.get_native_shard
    get = as_getter(source)
    return lambda key, tp, rank: shard(get(key), split_rule(key), tp, rank)


def slot_getter(source: NativeTensors) -> Callable[[Slot, int, int], torch.Tensor]:
    """``(slot, tp, rank) -> the tensor stored for it`` (``layout.cut``) from a native source."""
    get_shard = _shard_getter(source)

    def piece(slot: Slot, tp: int, rank: int) -> torch.Tensor:
        if slot.experts is None:
            return get_shard(slot.native, tp, rank)
        return cut(slot, expert_range(source, slot.native, *slot.experts), tp, rank)

    return piece


class _Counter:
    """Thread-safe progress over the tensors of every rank file."""

    def __init__(self, total: int, progress: Progress | None):
        self.total, self.done, self.progress, self.lock = total, 0, progress, threading.Lock()

    def step(self) -> None:
        with self.lock:
            self.done += 1
            if self.progress:
                self.progress(self.done, self.total)


def _default_writers(files: int) -> int:
    return max(1, min(files, os.cpu_count() or 1, 4))


def rank_file_plan(
    cfg: ModelConfig,
    chunks: list[Chunk],
    tp: int,
    pp: int,
    dtype: torch.dtype,
    args: argparse.Namespace,
    iteration: int,
    ep: int = 1,
    ep_rank: int = 0,
    grouped: bool = False,
) -> tuple[dict[str, Any], list[tuple[LazyTensor, Slot]]]:
    """One rank file of a Megatron checkpoint before any tensor: its pickled object (``args``, version, iteration
    and ``model``/``model{v}`` dicts of placeholders) and, in file order, (placeholder, slot) for each tensor
    (``layout.chunk_slots``: the rank's TP piece, ``split_rule``; for experts EP rank ``ep_rank``'s, as
    SequentialMLP or, ``grouped``, GroupedMLP tensors). ``slot_getter``/``layout.cut`` make each tensor."""
    full_shapes = native_shapes(cfg)
    state: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    plan: list[tuple[LazyTensor, Slot]] = []
    for chunk in chunks:
        tensors = state["model" if len(chunks) == 1 else f"model{chunk.index}"] = {}
        for slot in chunk_slots(cfg, chunk, pp, ep, ep_rank, grouped):
            shape = stored_shape(slot, full_shapes[slot.native], tp)
            tensors[slot.local] = LazyTensor(str(len(plan)), shape, dtype)
            plan.append((tensors[slot.local], slot))
    return state, plan


def save_mcore(
    source: NativeTensors,
    cfg: ModelConfig,
    out_dir: str | os.PathLike[str],
    tp: int = 1,
    pp: int = 1,
    iteration: int = 1,
    args: argparse.Namespace | None = None,
    num_layer_list: list[int] | None = None,
    vpp_layers: int | None = None,
    dtype: torch.dtype | None = None,
    progress: Progress | None = None,
    writers: int | None = None,
    seq_length: int | None = None,
    ep: int = 1,
    grouped: bool = False,
) -> list[Path]:
    """Write ``cfg``'s model as a Megatron legacy checkpoint with the given TP/PP/EP; returns the rank files.

    Without ``args``, ``build_args`` makes them, with ``seq_length`` and the source's config.json (``hf_config``
    of an HF source) carried.
    ``source``: a native state dict, a ``get(key)`` callable, or a checkpoint with ``get_native_shard``.
    MoE experts go to ``mp_rank_*_EEE`` files by EP rank, as SequentialMLP tensors or, ``grouped``
    (``--moe-grouped-gemm``), GroupedMLP ``weight1``/``weight2`` (``layout.chunk_slots``).
    The checkpoint is staged in a hidden directory; the tracker is written last. ``writers`` rank files are
    written at once (default: one per core, at most 4).
    """
    try:
        layout.check(cfg, layout.ParallelDims(dp=ep, tp=tp, pp=pp, ep=ep), num_layer_list, vpp_layers)
    except layout.LayoutError as err:
        raise BadInput(str(err), field=err.field) from err
    stages = pipeline_chunks(cfg.num_layers, pp, num_layer_list, vpp_layers)
    piece = slot_getter(source)
    segments_of = getattr(source, "shard_segments", None)
    dtype = dtype or as_getter(source)(FINAL_NORM).dtype
    args = args or build_args(
        cfg,
        tp,
        pp,
        dtype,
        num_layer_list,
        vpp_layers,
        hf_config=getattr(source, "hf_config", None),
        seq_length=seq_length,
        ep=ep,
        grouped=grouped,
    )
    out = Path(out_dir)
    ranks = [(p, t, e) for p in range(len(stages)) for e in range(ep) for t in range(tp)]
    total = sum(
        len(rank_file_plan(cfg, stages[p], tp, pp, dtype, args, iteration, ep, e, grouped)[1]) for p, _, e in ranks
    )
    count = _Counter(total, progress)

    def write_rank(it_dir: Path, p: int, t: int, e: int) -> Path:
        state, plan = rank_file_plan(cfg, stages[p], tp, pp, dtype, args, iteration, ep, e, grouped)
        rank_dir = it_dir / rank_dir_name(t, p, pp, e, ep)
        rank_dir.mkdir(parents=True)
        # The pickle goes first from shapes; each shard is then written while the next one is cut.
        with TorchFileWriter(rank_dir / MODEL_FILE, state, [lazy for lazy, _ in plan]) as writer:
            for lazy, slot in plan:
                segments = segments_of(slot.native, tp, t, dtype) if segments_of and slot.experts is None else None
                if segments is not None:  # the bytes exist as they are in the source: copy them
                    writer.write_segments(lazy, segments)
                else:
                    writer.write(lazy, piece(slot, tp, t).to(dtype).contiguous())
                count.step()
        return out / it_dir.name / rank_dir.name / MODEL_FILE

    with staging(out) as tmp:
        it_dir = tmp / iteration_dir_name(iteration)
        # Rank files are independent: several are written at once (the copies and CRCs release the GIL), which
        # is what lets a same-dtype conversion keep up with one `cp` on a machine with more than one core.
        with ThreadPoolExecutor(max_workers=writers or _default_writers(len(ranks)), thread_name_prefix="rank") as pool:
            files = list(pool.map(lambda pte: write_rank(it_dir, *pte), ranks))
        (tmp / TRACKER).write_text(str(iteration))
    return files


# ---------------------------------------------------------------- reading
