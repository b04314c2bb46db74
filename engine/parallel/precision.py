"""Precision as Megatron runs ``--bf16`` / ``--fp16``: low-precision compute over fp32 main weights.

- Trainable parameters are stored in fp32 (the main weights): their gradients accumulate over micro-batches in fp32
  and AdamW keeps fp32 states. FSDP2 (``engine.parallel.data_parallel``) shards all three over the data-parallel
  ranks and, through ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)``, hands forward and backward
  a bf16 (fp16) copy of each layer's parameters, gathered just in time, and reduces gradients in fp32.
- Frozen parameters (the base of a LoRA run) are stored once, in the compute dtype: they have no gradient and no
  optimizer state, so an fp32 copy would only cost memory (Megatron's LoRA keeps the base in bf16 too).
- Without ``bf16``/``fp16`` everything is fp32 and nothing is cast.

``param_dtypes(spec)`` is the one place these dtypes are decided: model construction builds (or loads) the weights
in ``base`` and ``parallelize`` enforces the storage dtypes with ``apply_param_dtypes`` before sharding.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.contract.spec import ModelSpec, TrainSpec


@dataclasses.dataclass(frozen=True)
class ParamDtypes:
    compute: torch.dtype  # what matmuls run in (FSDP2's param_dtype)
    trainable: torch.dtype  # storage of trainable parameters = main weights, their gradients and Adam states
    frozen: torch.dtype  # storage of frozen parameters (a LoRA base): one copy, in the compute dtype
    reduce: torch.dtype  # gradient reduction across ranks and accumulation over micro-batches
    base: torch.dtype  # the dtype to build / load the non-adapter weights in (frozen under LoRA, else trainable)


def compute_dtype(spec: ModelSpec) -> torch.dtype:
    """The dtype matmuls run in: bf16 / fp16 from the spec, else fp32."""
    if spec.bf16:
        return torch.bfloat16
    if spec.fp16:
        return torch.float16
    return torch.float32


def param_dtypes(spec: TrainSpec) -> ParamDtypes:
    """The run's dtypes from its ``bf16`` / ``fp16`` / ``lora_r`` flags."""
    compute = compute_dtype(spec)
    lora = spec.is_lora
    # --main-grads-dtype bf16 (precision-aware optimizer): trainable weights, hence their gradients, in bf16; the
    # fp32 master lives in the optimizer (engine.train.precision_optimizer)
    narrow = spec.use_precision_aware_optimizer and spec.main_grads_dtype == "bf16"
    return ParamDtypes(
        compute=compute,
        trainable=compute if narrow else torch.float32,
        frozen=compute,
        reduce=torch.float32,
        base=compute if lora else torch.float32,
    )


@torch.no_grad()
def apply_param_dtypes(model: nn.Module, dtypes: ParamDtypes) -> nn.Module:
    """Store every trainable parameter in ``dtypes.trainable`` and every frozen one in ``dtypes.frozen``, in place
    (before TP/FSDP wrap them: the Parameter objects stay, so optimizer and tying references hold)."""
    for param in model.parameters():
        wanted = dtypes.trainable if param.requires_grad else dtypes.frozen
        if param.is_floating_point() and param.dtype != wanted:
            param.data = param.data.to(wanted)
    return model
