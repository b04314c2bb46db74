"""One training iteration: forward/backward over this rank's micro-batches, clip, optimizer step, LR step.

Loss normalisation (torchtitan / Megatron ``calculate_per_token_loss``): every micro-batch's summed token loss is
divided by the number of labelled tokens of the WHOLE global batch (all micro-batches, all DP ranks), counted on the
host and all-reduced once before the first backward. FSDP sums gradients over ranks (divide factor 1), so the result
is the gradient of the global per-token mean whatever the DP size or the micro-batch split.

The only host sync per step is the finiteness check of the global grad norm: an overflowing (fp16) or non-finite
step is skipped, as Megatron skips it, and the scheduler does not advance on a skipped step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from engine.parallel.expert_parallel import reduce_over_context
from engine.torch_compat import foreach_mul_
from engine.train.batches import MicroBatch
from engine.train.metrics import StepRecord
from engine.train.optim import LossScaler, clip_grads
from engine.train.router_stats import RouterTracker
from engine.train.schedule import Scheduler
from engine.train.step_runner import StepRunner


@dataclasses.dataclass
class TrainState:
    """Everything that changes from step to step and is checkpointed besides model and optimizer."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0


def _global_counts(batches: Sequence[MicroBatch], runner: StepRunner) -> torch.Tensor:
    """[loss units (labelled tokens, or pairs for preference data), real tokens, sum of L^2] over the global batch
    (one all-reduce over DP)."""
    local = [
        sum(mb.loss_units for mb in batches),
        sum(mb.num_tokens for mb in batches),
        sum(n * n for mb in batches for n in mb.seq_lens),
    ]
    counts = torch.tensor(local, dtype=torch.float64, device=runner.device)
    dist.all_reduce(counts, group=runner.dp_group)
    return counts


def train_step(
    runner: StepRunner,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler,
    scaler: LossScaler,
    batches: Sequence[MicroBatch],
    state: TrainState,
    *,
    global_batch_size: int,
    clip_grad: float,
    router: RouterTracker | None = None,
) -> StepRecord:
    """``router``: the model's MoE layers (their aux loss is weighted per routed token; figures reported)."""
    start = time.perf_counter()
    params = [p for p in runner.module.parameters() if p.requires_grad]
    counts = _global_counts(batches, runner)
    denominator = counts[0].clamp(min=1.0)
    if router:  # per routed token 1 / (global real tokens): the objective is lm_loss + coeff × sum_layers balance
        router.set_token_weight(scaler.scale / counts[1].clamp(min=1.0))
    losses = runner.forward_backward(batches, denominator, scaler.scale)
    reduce_over_context(runner.module)  # experts under EP × CP
    if scaler.scale != 1.0:
        foreach_mul_([p.grad for p in params if p.grad is not None], 1.0 / scaler.scale)
    grad_norm = runner.grad_norm()
    skipped = not bool(torch.isfinite(grad_norm))  # the one host sync of the step
    if not skipped:
        clip_grads(params, clip_grad, grad_norm)
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    scaler.update(skipped)
    losses = runner.reduce(losses)  # for the logged loss only; read at the next log flush
    state.iteration += 1
    state.consumed_samples += global_batch_size
    state.skipped_iterations += int(skipped)
    return StepRecord(
        iteration=state.iteration,
        loss_sum=losses.token_sum,
        counts=counts,
        grad_norm=grad_norm,
        skipped=skipped,
        lr=scheduler.lr,
        loss_scale=scaler.scale,
        elapsed_s=time.perf_counter() - start,
        consumed_samples=state.consumed_samples,
        extra_losses=losses.extra,
        stats=losses.stats,
        router=router.step_figures() if router else None,
    )


def eval_step(runner: StepRunner, batches: Sequence[MicroBatch]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """([summed loss, loss units], summed stats) of one global batch, forward only, over every DP (and PP) rank:
    units are labelled tokens, or pairs for preference data, whose stats are the per-pair sums (rewards, log-probs).

    Call under ``torch.no_grad()`` with the model in eval mode; the loss is the training loss (same chunked CE,
    same TP/PP paths), summed rather than averaged so several batches combine exactly."""
    counts = _global_counts(batches, runner)
    losses = runner.reduce(runner.forward_only(batches))
    return torch.stack([losses.token_sum.double(), counts[0]]), losses.stats
