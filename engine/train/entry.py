"""The ``train`` job's entry point: ``run(spec, run) -> (outputs, summary)``, on one process or under torchrun.

It picks the loop a stage runs over the built ``Trainer``: stage grpo's rollouts and steps (``engine.train.grpo``,
with its own micro-batch loss handed to the trainer), every other stage the trainer's own ``fit``. Kept apart from
``engine.train.job`` so the trainer names no loop built on it (the grpo loop uses the trainer: one direction only).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from engine.contract.runfiles import RunDir
from engine.contract.spec import TrainSpec
from engine.parallel.device import Device, init_distributed
from engine.parallel.mesh import ensure_process_group
from engine.train.job import Plan, Trainer, plan_run


def build_trainer(spec: TrainSpec, run: RunDir, plan: Plan, device: Device) -> Trainer:
    """This rank's trainer with the stage's own loss (stage grpo's surrogate, else the trainer's LM/DPO losses)."""
    if spec.stage != "grpo":
        return Trainer(spec, run, plan, device, None)
    # stage grpo's modules only where it runs: its rewards bring jsonschema, regex and httpx into a rank
    from engine.train.grpo_tokens import grpo_loss

    return Trainer(spec, run, plan, device, grpo_loss(spec))


def fit(trainer: Trainer) -> tuple[dict[str, str], dict[str, Any]]:
    """The stage's loop over a built trainer: rollouts, rewards and grpo's own steps, or supervised/preference fit."""
    if trainer.spec.stage != "grpo":
        return trainer.fit()
    from engine.train.grpo import GRPOLoop

    return GRPOLoop(trainer).fit()


def run(spec: TrainSpec, run: RunDir) -> tuple[dict[str, str], dict[str, Any]]:
    plan = plan_run(spec, run)
    device = init_distributed(spec.resources.device_type)
    own_group = not dist.is_initialized()
    ensure_process_group(device)
    try:
        return fit(build_trainer(spec, run, plan, device))
    finally:
        # A group this call started for a plain single process is torn down here (in-process callers, tests);
        # under torchrun the CLI tears down and os._exit()s (the gloo exit-crash trap).
        if own_group and dist.is_initialized():
            dist.destroy_process_group()
