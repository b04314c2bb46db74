"""The final checkpoint of a run, in the seed's Megatron layout (and HF on request), written where the weights are.

Full fine-tuning / pretraining: ``<save>/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` +
``<save>/latest_checkpointed_iteration.txt`` (weights in the training dtype, ``args`` as MindSpeed's converters
write them), so ``convert``/``eval`` and MindSpeed read it. Each (TP, PP) rank of data-parallel rank 0 writes its
own rank file, as Megatron does: its stage's tensors one at a time (gathered over DP/TP for that one tensor only,
``full_tensor``), cut to its TP piece (``layout.split_rule``), streamed into the file. No rank ever holds more of the
model than its own part plus one tensor; the files are staged and published by rank 0 with the tracker last.

LoRA: the same layout holding the adapters only (small: gathered on rank 0), under MindSpeed's PEFT key names
(``...linear_qkv.lora_A.default.weight``), with ``args.lora_r``/``lora_alpha``/``lora_target_modules`` and
``args.lora_base`` = the ``load`` path. To merge, give the base checkpoint as ``load_dir`` and this directory as
``lora_load`` to a ``convert`` job (MindSpeed's ``--load`` + ``--lora-load``): W + alpha/r · B @ A per module.

``save_hf`` writes the (merged) full model as HF safetensors under ``<save>/hf`` by the conversion's own streaming
path, from the files just written (and, for LoRA, the base it was trained on): one tensor in memory at a time.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from engine.checkpoint.hf import save_hf, staging
from engine.checkpoint.layout import OUTPUT, Slot, cut, pipeline_chunks, rank_dir_name, shard, split_rule
from engine.checkpoint.megatron_read import MODEL_FILE
from engine.checkpoint.megatron_write import build_args, rank_file_plan
from engine.checkpoint.sharded import native_name
from engine.checkpoint.torchfile import TorchFileWriter
from engine.contract.inspect import TRACKER, iteration_dir_name
from engine.contract.model_config import ModelConfig
from engine.contract.spec import TrainSpec
from engine.model.lora import to_mindspeed_keys
from engine.parallel.mesh import batch_mesh
from engine.parallel.tensor_parallel import full_tensor
from engine.train.step_runner import StepRunner


def lora_rank_states(
    adapters: dict[str, torch.Tensor],
    cfg: ModelConfig,
    tp: int,
    pp: int,
    num_layer_list: list[int] | None = None,
    vpp_layers: int | None = None,
) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """Full adapters cut as MindSpeed stores a LoRA run of this TP/PP: rank dir -> {"model" | "model{v}": tensors}.

    TP: ``split_rule`` (column targets: A replicated, B like the base rows incl. [gate_k; up_k]; row targets: A on
    dim 1, B replicated); PP: each stage's layers renumbered from 0 (``pipeline_chunks``)."""
    out: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for p, chunks in enumerate(pipeline_chunks(cfg.num_layers, pp, num_layer_list, vpp_layers)):
        for t in range(tp):
            models = {}
            for chunk in chunks:
                local = {}
                for i, layer in enumerate(chunk.layers):
                    prefix = f"decoder.layers.{layer}."
                    for key in (k for k in adapters if k.startswith(prefix)):
                        piece = shard(adapters[key], split_rule(key), tp, t)
                        local[f"decoder.layers.{i}." + key[len(prefix) :]] = piece.contiguous().clone()
                models["model" if len(chunks) == 1 else f"model{chunk.index}"] = local
            out[rank_dir_name(t, p, pp)] = models
    return out


def _write_lora(
    state: dict[str, torch.Tensor], cfg: ModelConfig, save: Path, iteration: int, spec: TrainSpec, dtype: torch.dtype
) -> Path:
    adapters = {k: v.to(dtype) for k, v in state.items() if ".lora_A." in k or ".lora_B." in k}
    tp, pp = spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size
    layers, vpp = spec.num_layer_list, spec.num_layers_per_virtual_pipeline_stage
    args = build_args(cfg, tp, pp, dtype, layers, vpp, seq_length=spec.seq_length)
    extra = {
        "lora_r": spec.lora_r,
        "lora_alpha": spec.lora_alpha,
        "lora_target_modules": list(spec.lora_target_modules),
        "lora_base": spec.load,
        "iteration": iteration,
    }
    args = argparse.Namespace(**{**vars(args), **extra})
    with staging(save, name=".staging-export") as tmp:  # published whole (files synced, tracker last) or not at all
        for name, models in lora_rank_states(adapters, cfg, tp, pp, layers, vpp).items():
            rank_dir = tmp / iteration_dir_name(iteration) / name
            rank_dir.mkdir(parents=True, exist_ok=True)
            chunks = {k: to_mindspeed_keys(v) for k, v in models.items()}
            torch.save(
                {"args": args, "checkpoint_version": 3.0, "iteration": iteration, **chunks}, rank_dir / MODEL_FILE
            )
        (tmp / TRACKER).write_text(str(iteration))
    return save / iteration_dir_name(iteration)


def _stage_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's model tensors (local pieces: DTensors under TP/FSDP) under native keys."""
    return {native_name(k): v for k, v in module.state_dict().items()}


def _full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective over the tensor's mesh when it is a DTensor; FSDP over strided TP shards too)."""
    return full_tensor(value)


def _write_own_rank_file(
    module: nn.Module,
    mesh: DeviceMesh,
    cfg: ModelConfig,
    spec: TrainSpec,
    it_dir: Path,
    iteration: int,
    dtype: torch.dtype,
) -> None:
    """This rank's ``mp_rank_TT[_PPP]`` file (written by DP rank 0; the other DP ranks take part in the gathers).
    Every rank of a stage walks the same keys in the same order, so each ``full_tensor`` meets its peers."""
    tp, pp = spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size
    t, p = mesh["tp"].get_local_rank(), mesh["pp"].get_local_rank()
    writes = batch_mesh(mesh).get_local_rank() == 0  # DP (× CP) rank 0: the others hold the same weights
    chunks = pipeline_chunks(cfg.num_layers, pp, spec.num_layer_list, spec.num_layers_per_virtual_pipeline_stage)[p]
    grouped = bool(getattr(spec, "moe_grouped_gemm", False))  # MindSpeed's --moe-grouped-gemm: GroupedMLP tensors
    layers, vpp = spec.num_layer_list, spec.num_layers_per_virtual_pipeline_stage
    args = build_args(cfg, tp, pp, dtype, layers, vpp, seq_length=spec.seq_length, grouped=grouped)
    state, plan = rank_file_plan(cfg, chunks, tp, pp, dtype, args, iteration, grouped=grouped)
    tensors = _stage_tensors(module)
    layer_experts: dict[str, torch.Tensor] = {}  # one layer's gathered experts, cut into many SequentialMLP slots

    def full(slot: Slot) -> torch.Tensor:
        # a tied model's last stage holds the embedding's copy as its head (layout.chunk_keys)
        native = slot.native
        if slot.experts is None:
            return _full(tensors[native] if native in tensors else tensors[OUTPUT])
        if native not in layer_experts:
            if not any(k.rsplit(".mlp.", 1)[0] == native.rsplit(".mlp.", 1)[0] for k in layer_experts):
                layer_experts.clear()  # a new layer: the previous one's experts are done
            layer_experts[native] = _full(tensors[native])
        return layer_experts[native][slot.experts[0] : slot.experts[1]]

    if not writes:  # take part in each gather, keep nothing
        for _, slot in plan:
            full(slot)
        return
    rank_dir = it_dir / rank_dir_name(t, p, pp)
    rank_dir.mkdir(parents=True, exist_ok=True)
    with TorchFileWriter(rank_dir / MODEL_FILE, state, [lazy for lazy, _ in plan]) as writer:
        for lazy, slot in plan:  # the conversion's own cut (layout.cut): one layout for both writers
            writer.write(lazy, cut(slot, full(slot), tp, t).to(dtype).contiguous())


def _gather_adapters(module: nn.Module, mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """Every LoRA adapter of the model, whole, on global rank 0 (empty elsewhere); collective."""
    mine = {k: _full(v).detach().cpu() for k, v in _stage_tensors(module).items() if ".lora_A." in k or ".lora_B." in k}
    sender = batch_mesh(mesh).get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if sender else {}, gathered, dst=0)
    return {k: v for part in gathered or [] for k, v in part.items()}


def _save_hf(cfg: ModelConfig, spec: TrainSpec, save: Path, dtype: torch.dtype) -> None:
    """``<save>/hf`` from the checkpoint just written (merged onto its base for LoRA), streamed as ``convert`` does."""
    from engine.checkpoint.load import open_checkpoint
    from engine.checkpoint.lora_merge import LoraOverlay
    from engine.checkpoint.megatron_read import MegatronCheckpoint
    from engine.checkpoint.sources import SeededInit

    source: Any
    if not spec.is_lora:
        source = MegatronCheckpoint(save)
    else:  # the base never changed: it is what was loaded (or the seeded init of a LoRA run from scratch)
        base = open_checkpoint(spec.load)[1] if spec.load else SeededInit(cfg, spec.seed)
        source = LoraOverlay(base, save, spec.lora_alpha, spec.lora_r)
    save_hf(source, cfg, save / "hf", dtype=dtype)


def export_final(
    runner: StepRunner,
    mesh: DeviceMesh,
    cfg: ModelConfig,
    spec: TrainSpec,
    save: Path,
    iteration: int,
    dtype: torch.dtype,
) -> dict[str, str]:
    """Write the final checkpoint(s); returns the runner outputs that name them. Collective."""
    outputs = {
        "checkpoint": str(save),
        "checkpoint_iteration": str(iteration),
        "checkpoint_dir": str(save / iteration_dir_name(iteration)),
    }
    rank0 = dist.get_rank() == 0
    if spec.is_lora:
        adapters = _gather_adapters(runner.module, mesh)
        if rank0:
            _write_lora(adapters, cfg, save, iteration, spec, dtype)
    else:
        stage = staging(save, name=".staging-export")
        tmp = stage.__enter__() if rank0 else stage.tmp
        dist.barrier()  # the staging directory exists
        _write_own_rank_file(runner.module, mesh, cfg, spec, tmp / iteration_dir_name(iteration), iteration, dtype)
        dist.barrier()  # every rank file is complete
        if rank0:
            (tmp / TRACKER).write_text(str(iteration))
            stage.__exit__(None, None, None)  # publish: the iteration directory, then the tracker
    if spec.save_hf:
        if rank0:
            _save_hf(cfg, spec, save, dtype)
        outputs["hf"] = str(save / "hf")
    dist.barrier()
    return outputs
