"""What one training rank builds (train, its DPO/GRPO reference, the trace): its part of the model on the ``meta``
device (PP split -> TP -> activation checkpointing -> FSDP), ``to_empty`` on the device, then only its own slices
filled (``engine.checkpoint.sharded``) and, for LoRA, adapters seeded as on the whole model.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from engine.checkpoint.sources import WeightSource
from engine.contract.model_config import ModelConfig
from engine.contract.spec import TrainSpec


def build_rank_model(
    cfg: ModelConfig,
    mesh: DeviceMesh,
    spec: TrainSpec,
    global_batch_size: int,
    seq_length: int,
    device: torch.device,
    base: WeightSource | None,
    frozen: bool = False,
) -> torch.nn.Module:
    """This rank's model: built on meta, split/sharded, materialised on ``device``, filled from ``base`` (None: left
    empty for a DCP restore) and, for LoRA (``spec.lora_r``), adapters seeded as ``apply_lora(seed=spec.seed)``
    would on the full model. ``frozen``: no parameter needs a gradient (a reference model), so every one is stored
    in the compute dtype. Returns the module (a ``PipelineModel`` under PP)."""
    from engine.checkpoint.sharded import fill_parts
    from engine.checkpoint.sources import SeededLoraInit
    from engine.model.families import build_model
    from engine.parallel.parallelize import parallelize
    from engine.parallel.pipeline_parallel import build_pipeline_model

    with torch.device("meta"):
        model: torch.nn.Module = build_model(cfg)
    model.requires_grad_(not frozen)
    adapted: list[str] = []
    if spec.lora_r is not None:  # spelled out so mypy narrows lora_r to int (is_lora cannot)
        from engine.model.lora import apply_lora

        adapted = apply_lora(model, spec.lora_r, spec.lora_alpha, spec.lora_dropout, spec.lora_target_modules)
    if mesh["pp"].size() > 1:
        model = build_pipeline_model(
            model, mesh, spec, global_batch_size, seq_length, lambda part: parallelize(part, mesh, spec), device=device
        )
        parts: list[torch.nn.Module] = list(model.pipeline.parts)
    else:
        model = parallelize(model, mesh, spec)
        parts = [model]
    for part in parts:
        part.to_empty(device=device)
    lora = SeededLoraInit(cfg, adapted, spec.lora_r, spec.seed) if adapted and spec.lora_r is not None else None
    fill_parts(parts, base, lora)
    return model
