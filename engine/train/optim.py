"""AdamW with Megatron's weight-decay groups, gradient clipping by global norm, and the fp16 loss scaler.

Megatron (``megatron/core/optimizer/__init__.py`` ``_get_param_groups``) exempts biases and every 1-D parameter
(norm weights) from weight decay; so do we. The loss scaler follows Megatron's ``DynamicGradScaler``: halve the scale
after ``hysteresis`` overflowing iterations, double it after ``loss_scale_window`` clean ones, never under
``min_loss_scale``; an overflowing iteration skips the optimizer step and counts as skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from engine.contract.spec import TrainSpec
from engine.parallel.device import has_fused_adamw
from engine.train.precision_optimizer import PrecisionAwareAdamW, StateDtypes


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters split into decayed (matrices) and not decayed (biases, norms)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or param.ndim == 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


FOREACH_GROUP_BYTES = 256 * 2**20  # the fp32 temporary a foreach AdamW step may allocate per parameter group


def _local_numel(param: torch.Tensor) -> int:
    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def bounded_groups(groups: list[dict[str, Any]], limit_bytes: int = FOREACH_GROUP_BYTES) -> list[dict[str, Any]]:
    """``groups`` cut into consecutive pieces of at most ``limit_bytes`` of fp32 (this rank's shards), so the
    temporaries of a foreach step (``sqrt(v)`` of the group) stay under that; a single larger tensor is its own group."""
    out: list[dict[str, Any]] = []
    for group in groups:
        piece: list[nn.Parameter] = []
        size = 0
        for param in group["params"]:
            n = _local_numel(param) * 4
            if piece and size + n > limit_bytes:
                out.append({**group, "params": piece})
                piece, size = [], 0
            piece.append(param)
            size += n
        if piece:
            out.append({**group, "params": piece})
    return out


def build_optimizer(model: nn.Module, spec: TrainSpec) -> torch.optim.Optimizer:
    """AdamW with no full-size temporary: torch's fused kernel where the device has one (in place, per tensor list),
    else foreach over groups of at most ``FOREACH_GROUP_BYTES``; with ``use_precision_aware_optimizer`` the
    precision-aware (and possibly offloaded) AdamW of ``engine.train.precision_optimizer``."""
    groups = param_groups(model, spec.weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    kwargs: dict[str, Any] = {"lr": spec.lr, "betas": (spec.adam_beta1, spec.adam_beta2), "eps": spec.adam_eps}
    if spec.use_precision_aware_optimizer:
        dtypes = StateDtypes.from_names(spec.main_params_dtype, spec.exp_avg_dtype, spec.exp_avg_sq_dtype)
        fraction = spec.optimizer_offload_fraction if spec.optimizer_cpu_offload else 0.0
        return PrecisionAwareAdamW(groups, dtypes=dtypes, offload_fraction=fraction, **kwargs)
    if has_fused_adamw(spec.resources.device_type):
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    return torch.optim.AdamW(bounded_groups(groups), foreach=True, **kwargs)


def grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by the device mesh they are sharded over (plain tensors together): a foreach kernel or a
    DTensor reduction takes one mesh at a time, and expert-parallel experts live on the (edp, ep) mesh, the rest
    on dp (torchtitan ``_clip_grad_norm_with_ep``)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def _fp32_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` (foreach, L2) with every per-tensor norm accumulated and returned in fp32,
    as Megatron's ``get_grad_norm_fp32`` (``multi_tensor_l2norm``) does: bf16 main grads (``main_grads_dtype``) must
    not give a bf16-rounded norm, nor a bf16 sum of squares. For fp32 gradients it is torch's computation."""
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(list(norms)), 2.0)


def total_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of all gradients across every rank, in fp32 whatever the gradients' dtype (a 0-d tensor; no
    host sync)."""
    norms = []
    for group in _by_mesh(grads(params)):
        norm = _fp32_norm(group)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # sharded grads: the partial norms are reduced across the mesh here
        norms.append(norm)
    if len(norms) == 1:
        return norms[0]
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_grads(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    if max_norm > 0:
        for group in _by_mesh(params):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=True)


class LossScaler:
    """Megatron's loss scaling: constant (``loss_scale``), dynamic (fp16), or none (scale 1, bf16/fp32)."""

    def __init__(self, spec: TrainSpec):
        self.dynamic = bool(spec.fp16) and spec.loss_scale is None
        self.scale = float(spec.loss_scale or (spec.initial_loss_scale if spec.fp16 else 1.0))
        self.min_scale = spec.min_loss_scale
        self.window = spec.loss_scale_window
        self.hysteresis = spec.hysteresis
        self._growth = 0
        self._hysteresis_left = spec.hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self._growth = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * 0.5, self.min_scale)
            return
        self._growth += 1
        if self._growth == self.window:
            self._growth = 0
            self._hysteresis_left = self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth": self._growth, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._growth = int(state["growth"])
        self._hysteresis_left = int(state["hysteresis_left"])
