"""Learning-rate schedule with Megatron/MindSpeed semantics (``megatron/core/optimizer_param_scheduler.py``).

Steps count iterations. Warmup: ``lr_warmup_fraction × lr_decay_iters`` when the fraction is given, else
``lr_warmup_iters``; linear from ``lr_warmup_init`` to ``lr``. Then ``constant`` stays at ``lr``; ``linear`` and
``cosine`` go down to ``min_lr`` at ``lr_decay_iters`` (default ``train_iters``) and stay there; the LR at step ``s`` is
the one the optimizer uses for iteration ``s + 1``. Megatron's log line prints the LR after the scheduler stepped, so
iteration 1 of a 390-iteration linear run logs ``lr × (1 - 1/390)`` with min_lr — the seed's 1.247115E-06.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from engine.contract.spec import TrainSpec


@dataclasses.dataclass
class LRSchedule:
    max_lr: float
    min_lr: float
    decay_style: str
    decay_steps: int
    warmup_steps: float = 0.0
    init_lr: float = 0.0

    def lr_at(self, step: int) -> float:
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            warm = max(self.warmup_steps, 1)
            return max(self.min_lr, self.max_lr * math.sqrt(warm) / math.sqrt(max(step, 1)))
        ratio = (step - self.warmup_steps) / max(self.decay_steps - self.warmup_steps, 1)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise ValueError(f"lr_decay_style: {self.decay_style!r} is not supported")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)


def schedule_from_spec(spec: TrainSpec) -> LRSchedule:
    decay = spec.lr_decay_iters or spec.train_iters
    if spec.lr_warmup_fraction is not None:
        warmup = spec.lr_warmup_fraction * decay  # a float, as Megatron keeps it
    else:
        warmup = spec.lr_warmup_iters
    return LRSchedule(spec.lr, spec.min_lr, spec.lr_decay_style, decay, warmup, spec.lr_warmup_init)


class Scheduler(LambdaLR):
    """``torch.optim.lr_scheduler.LambdaLR`` over ``LRSchedule.lr_at``: every group's base LR is 1, so the LR of step
    ``s`` is exactly ``lr_at(s)`` (no max_lr × ratio rounding). Its state (the step count) goes into meta.json."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule):
        self.schedule = schedule
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = 1.0
        super().__init__(optimizer, schedule.lr_at)

    @property
    def lr(self) -> float:
        return float(self.get_last_lr()[0])

    def state_dict(self) -> dict[str, Any]:
        state = {k: v for k, v in super().state_dict().items() if k != "schedule"}
        return {**state, "schedule": dataclasses.asdict(self.schedule)}  # the schedule for the record only

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "last_epoch" not in state:  # written before LambdaLR: {"num_steps": N, "schedule": ...}
            state = {
                "last_epoch": int(state["num_steps"]),
                "_step_count": int(state["num_steps"]) + 1,
                "lr_lambdas": [None] * len(self.lr_lambdas),
            }
        super().load_state_dict({k: v for k, v in state.items() if k != "schedule"})
        # The optimizer's LR follows the restored step even when its own state was not loaded (no_load_optim).
        lr = self.schedule.lr_at(self.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._last_lr = [lr] * len(self.optimizer.param_groups)
