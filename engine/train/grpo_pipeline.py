"""Stage grpo under pipeline parallelism: the loss and the no-grad log-prob passes on a pipeline's last stage.

The schedule hands the last stage each micro-batch's final hidden states and its labels, padded to the pipeline's
width (``engine.parallel.pipeline_parallel.make_loss_fn``), and the micro-batch's index in the step; the rollout's
micro-batches (advantages, masks, old and reference log-probs) are kept by ``begin`` and looked up by that index.
The labelled positions are found from the padded labels: padding sits after every real token, so they come in the
order the unpadded micro-batch lists them (``loss_index``), the order of the completion tokens' other fields.

The old policy's log-probs (μ > 1) and the reference's (β > 0) come from forward-only schedules
(``TokenLogps``): the policy's own pipeline, a LoRA policy's with the adapters off, or the frozen reference's
pipeline (built with the policy's split, ``engine.train.dpo.build_reference``). Only the last stage computes them,
and only the last stage's loss reads them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from engine.contract.spec import TrainSpec
from engine.model.lora import adapters_disabled
from engine.parallel.data_parallel import reshard_all
from engine.train.batches import MicroBatch
from engine.train.grpo_tokens import (
    STEP_STATS,
    GRPOMicroBatch,
    TokenRows,
    hidden_token_logps,
    surrogate_config,
    surrogate_losses,
)
from engine.train.metrics import PER
from engine.train.step_runner import PipelineRunner


class PipelineGRPOLoss:
    """Stage grpo's loss on a pipeline's last stage (``step_runner.PipelineLoss``): each micro-batch's numerator of
    ``loss_type``'s aggregation; its stats kept by index (the schedule's shape inference may call it again) and
    summed over the step, zeros on the other stages."""

    def __init__(self, spec: TrainSpec) -> None:
        self.cfg, self.loss_type = surrogate_config(spec), spec.loss_type
        self.chunk, self.temperature = spec.cross_entropy_chunk_size, spec.temperature
        self.batches: list[GRPOMicroBatch] = []
        self.device = torch.device("cpu")
        self.per_batch: dict[int, dict[str, torch.Tensor]] = {}

    def begin(self, batches: Sequence[MicroBatch], device: torch.device) -> None:
        self.batches = [cast(GRPOMicroBatch, mb).to(device) for mb in batches]
        self.device, self.per_batch = device, {}

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        names = [*STEP_STATS, *(f"{name}{PER}" for name in STEP_STATS)]
        out = {name: torch.zeros((), device=self.device) for name in names}
        for stats in self.per_batch.values():
            for name, value in stats.items():
                out[name] = out[name] + value
        return out

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, head: torch.Tensor, index: int) -> torch.Tensor:
        g = self.batches[index]
        logp, ent = hidden_token_logps(hidden, head, TokenRows.of(labels), self.chunk, self.temperature, True, False)
        assert ent is not None
        losses = surrogate_losses(self.cfg, self.loss_type, g, logp, ent)
        self.per_batch[index] = {name: value.detach() for name, value in losses.stats.items()}
        return losses.token_sum


class _Capture:
    """A last-stage loss recording each micro-batch's token log-probs instead of a loss."""

    def __init__(self, chunk: int, temperature: float) -> None:
        self.chunk, self.temperature = chunk, temperature
        self.logps: dict[int, torch.Tensor] = {}

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        return {}

    def begin(self, batches: Sequence[MicroBatch], device: torch.device) -> None:
        self.logps = {}

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, head: torch.Tensor, index: int) -> torch.Tensor:
        logp, _ = hidden_token_logps(hidden, head, TokenRows.of(labels), self.chunk, self.temperature, False, False)
        self.logps[index] = logp.detach()
        return logp.sum() * 0.0


class TokenLogps:
    """Forward-only passes of a rollout's micro-batches through a pipeline: each micro-batch's token log-probs on the
    last stage, None on the others."""

    def __init__(self, spec: TrainSpec) -> None:
        self.capture = _Capture(spec.cross_entropy_chunk_size, spec.temperature)

    def __call__(
        self, runner: PipelineRunner, batches: Sequence[MicroBatch], adapters_off: bool = False
    ) -> list[torch.Tensor] | None:
        base = adapters_disabled(runner.module) if adapters_off else contextlib.nullcontext()
        with torch.no_grad(), runner.using(self.capture), base:
            runner.forward_only(batches)
        # forward-only passes leave FSDP's kept-gathered groups gathered (``data_parallel.reshard_all``)
        reshard_all(cast(list[nn.Module], runner.pipeline.parts))
        if not runner.pipeline.is_last:
            return None
        return [self.capture.logps[i] for i in range(len(batches))]
