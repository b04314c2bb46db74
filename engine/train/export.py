"""The final checkpoint of a run, in the seed's Megatron layout (and HF on request).

Full fine-tuning / pretraining: ``<save>/iter_XXXXXXX/mp_rank_00[_000]/model_optim_rng.pt`` +
``<save>/latest_checkpointed_iteration.txt`` through ``engine.checkpoint.megatron.save_mcore`` (weights in the
training dtype, ``args`` as MindSpeed's converters write them), so ``convert``/``eval`` and MindSpeed read it.

LoRA: the same layout holding the adapters only, under MindSpeed's PEFT key names
(``...linear_qkv.lora_A.default.weight``), with ``args.lora_r``/``lora_alpha``/``lora_target_modules`` and
``args.lora_base`` = the ``load`` path. To merge, give the base checkpoint as ``load_dir`` and this directory as
``lora_load`` to a ``convert`` job (MindSpeed's ``--load`` + ``--lora-load``): W + alpha/r · B @ A per module.
``save_hf`` writes the merged full model as HF safetensors under ``<save>/hf``.

The full state dict is gathered on rank 0 only (``StepRunner.full_state_dict``); other ranks wait.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.checkpoint.hf import save_hf
from engine.checkpoint.layout import pipeline_chunks, rank_dir_name, shard, split_rule
from engine.checkpoint.megatron import (
    MODEL_FILE,
    TRACKER,
    build_args,
    iteration_dir_name,
    save_mcore,
)
from engine.model.config import ModelConfig
from engine.model.lora import merge_lora, to_mindspeed_keys
from engine.train.step_runner import StepRunner


def merged_weights(state: dict[str, torch.Tensor], alpha: float, r: int) -> dict[str, torch.Tensor]:
    """Base weights with every adapter folded in (fp32 merge), adapter keys dropped."""
    out = {k: v for k, v in state.items() if ".lora_A." not in k and ".lora_B." not in k}
    for key in [k for k in state if k.endswith(".lora_A.weight")]:
        module = key[: -len(".lora_A.weight")]
        out[module + ".weight"] = merge_lora(state[module + ".weight"], state[key], state[module + ".lora_B.weight"], alpha, r)
    return out


def lora_rank_states(adapters: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, pp: int,
                     num_layer_list: list[int] | None = None, vpp_layers: int | None = None
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
                        local[f"decoder.layers.{i}." + key[len(prefix):]] = piece.contiguous().clone()
                models["model" if len(chunks) == 1 else f"model{chunk.index}"] = local
            out[rank_dir_name(t, p, pp)] = models
    return out


def _write_lora(state: dict[str, torch.Tensor], cfg: ModelConfig, save: Path, iteration: int, spec: Any,
                dtype: torch.dtype) -> Path:
    adapters = {k: v.to(dtype) for k, v in state.items() if ".lora_A." in k or ".lora_B." in k}
    tp, pp = spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size
    layers, vpp = spec.num_layer_list, spec.num_layers_per_virtual_pipeline_stage
    args = build_args(cfg, tp, pp, dtype, layers, vpp, seq_length=spec.seq_length)
    extra = {"lora_r": spec.lora_r, "lora_alpha": spec.lora_alpha, "lora_target_modules": list(spec.lora_target_modules),
             "lora_base": spec.load, "iteration": iteration}
    args = argparse.Namespace(**{**vars(args), **extra})
    it_dir = save / iteration_dir_name(iteration)
    for name, models in lora_rank_states(adapters, cfg, tp, pp, layers, vpp).items():
        rank_dir = it_dir / name
        rank_dir.mkdir(parents=True, exist_ok=True)
        tmp = rank_dir / (MODEL_FILE + ".tmp")
        chunks = {k: to_mindspeed_keys(v) for k, v in models.items()}
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration, **chunks}, tmp)
        os.replace(tmp, rank_dir / MODEL_FILE)
    tracker = save / (TRACKER + ".tmp")
    tracker.write_text(str(iteration))
    os.replace(tracker, save / TRACKER)
    return it_dir


def export_final(runner: StepRunner, cfg: ModelConfig, spec: Any, save: Path, iteration: int,
                 dtype: torch.dtype) -> dict[str, str]:
    """Write the final checkpoint(s); returns the runner outputs that name them. Collective."""
    state = runner.full_state_dict()  # the whole model on rank 0 (each pipeline stage gathers and sends its own)
    outputs = {"checkpoint": str(save), "checkpoint_iteration": str(iteration),
               "checkpoint_dir": str(save / iteration_dir_name(iteration))}
    if dist.get_rank() == 0:
        lora = spec.lora_r is not None
        if lora:
            _write_lora(state, cfg, save, iteration, spec, dtype)
        else:
            save_mcore(state, cfg, save, tp=spec.tensor_model_parallel_size, pp=spec.pipeline_model_parallel_size,
                       iteration=iteration, dtype=dtype, num_layer_list=spec.num_layer_list,
                       vpp_layers=spec.num_layers_per_virtual_pipeline_stage, seq_length=spec.seq_length)
        if spec.save_hf:
            weights = merged_weights(state, spec.lora_alpha, spec.lora_r) if lora else state
            save_hf(weights, cfg, save / "hf", dtype=dtype)
    if spec.save_hf:
        outputs["hf"] = str(save / "hf")
    dist.barrier()
    return outputs
