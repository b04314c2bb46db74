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
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from engine.model.loss import chunked_cross_entropy
from engine.parallel.pipeline_parallel import PipelineModel
from engine.parallel.tensor_parallel import vocab_parallel_cross_entropy
from engine.train.batches import MicroBatch
from engine.train.metrics import StepRecord
from engine.train.optim import LossScaler, clip_grads, total_grad_norm
from engine.train.schedule import Scheduler


@dataclasses.dataclass
class TrainState:
    """Everything that changes from step to step and is checkpointed besides model and optimizer."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0


def _global_counts(batches: Sequence[MicroBatch], group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """[labelled tokens, real tokens, sum of L^2] over the global batch (one all-reduce)."""
    local = [
        sum(mb.num_loss_tokens for mb in batches),
        sum(mb.num_tokens for mb in batches),
        sum(n * n for mb in batches for n in mb.seq_lens),
    ]
    counts = torch.tensor(local, dtype=torch.float64, device=device)
    dist.all_reduce(counts, group=group)
    return counts


def micro_batch_loss(model: nn.Module, mb: MicroBatch, chunk_size: int) -> torch.Tensor:
    """Sum of the token losses of one micro-batch (fp32 scalar), never materialising (tokens × vocab) logits."""
    hidden = model(mb.input_ids, position_ids=mb.position_ids, segment_ids=mb.segment_ids, return_hidden=True)
    if getattr(model, "tp_mesh", None) is not None:  # tensor parallel: vocab-sharded head (sequence-sharded hidden)
        return vocab_parallel_cross_entropy(hidden, model.output_weight(), mb.labels, chunk_size, mb.loss_index)[0]
    # Only rows with a label go through the head: the indices were computed on the host, so no device sync here.
    rows = hidden.flatten(0, 1).index_select(0, mb.loss_index)  # (N, H)
    loss_sum, _ = chunked_cross_entropy(rows, model.output_weight(), mb.loss_labels, chunk_size)
    return loss_sum


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Scheduler,
    scaler: LossScaler,
    batches: Sequence[MicroBatch],
    state: TrainState,
    *,
    global_batch_size: int,
    clip_grad: float,
    chunk_size: int,
    dp_group: dist.ProcessGroup | None,
    device: torch.device,
) -> StepRecord:
    start = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    counts = _global_counts(batches, dp_group, device)
    denominator = counts[0].clamp(min=1.0)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    pipeline = isinstance(model, PipelineModel)
    if pipeline:  # the schedule runs every micro-batch; the same normalisation is applied on the last stage
        loss_sum += model.forward_backward(batches, denominator, scaler.scale)
    for mb in [] if pipeline else batches:
        mb = mb.to(device)
        part = micro_batch_loss(model, mb, chunk_size)
        (part * (scaler.scale / denominator)).backward()
        loss_sum += part.detach()
    if scaler.scale != 1.0:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], 1.0 / scaler.scale)
    # Pipeline: per-stage norms (a tied embedding counted once) combined over the stages.
    if pipeline:
        grad_norm = model.combine_grad_norm(total_grad_norm(model.grad_norm_parameters()))
    else:
        grad_norm = total_grad_norm(params)
    skipped = not bool(torch.isfinite(grad_norm))  # the one host sync of the step
    if not skipped:
        clip_grads(params, clip_grad, grad_norm)
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    scaler.update(skipped)
    dist.all_reduce(loss_sum, group=dp_group)  # for the logged loss only; read at the next log flush
    if pipeline:
        model.reduce_loss(loss_sum)  # the loss exists on the last stage only
    state.iteration += 1
    state.consumed_samples += global_batch_size
    state.skipped_iterations += int(skipped)
    return StepRecord(
        iteration=state.iteration,
        loss_sum=loss_sum,
        counts=counts,
        grad_norm=grad_norm,
        skipped=skipped,
        lr=scheduler.lr,
        loss_scale=scaler.scale,
        elapsed_s=time.perf_counter() - start,
        consumed_samples=state.consumed_samples,
    )


def eval_step(model: nn.Module, batches: Sequence[MicroBatch], *, chunk_size: int, dp_group: dist.ProcessGroup | None,
              device: torch.device) -> torch.Tensor:
    """[summed token loss, labelled tokens] of one global batch, forward only, over every DP (and PP) rank.

    Call under ``torch.no_grad()`` with the model in eval mode; the loss is the training loss (same chunked CE,
    same TP/PP paths), summed rather than averaged so several batches combine exactly."""
    counts = _global_counts(batches, dp_group, device)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    if isinstance(model, PipelineModel):
        loss_sum += model.forward_only(batches)
    else:
        for mb in batches:
            loss_sum += micro_batch_loss(model, mb.to(device), chunk_size)
    dist.all_reduce(loss_sum, group=dp_group)
    if isinstance(model, PipelineModel):
        model.reduce_loss(loss_sum)
    return torch.stack([loss_sum.double(), counts[0]])
