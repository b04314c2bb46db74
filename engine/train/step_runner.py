"""How this rank runs a training step, behind one interface whatever the layout (the loop never sees the model type).

- ``ModuleRunner``: one module holds every layer of the rank (plain, FSDP2, TP/SP, or a mix): the micro-batches run
  one after another through forward, the chunked loss (vocab-parallel when a TP mesh is given) and backward.
- ``PipelineRunner``: this rank's pipeline stages; ``torch.distributed.pipelining``'s schedule runs the micro-batches.

Both offer: ``forward_backward`` over the step's micro-batches (each micro-batch's summed token loss divided by the
step's global token count, times the loss scale, before backward), ``forward_only`` (validation), ``grad_norm`` (the
global L2 norm over every rank), ``reduce`` (the step's losses summed over DP and present on every PP rank), and the
checkpoint view: ``module`` (this rank's parameters under native FQNs, for the optimizer, DCP and the final export,
which each rank writes from its own part: ``engine.train.export``).

Losses travel as ``Losses``: the summed token loss plus extra named terms (e.g. a MoE load-balancing loss). A
micro-batch loss function (``MicroBatchLoss``) may return extra terms: they are added to the objective as they are
(already normalised by whoever makes them) and reported summed over micro-batches and ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from engine.model.decoder_lm import decoder_lm
from engine.model.loss import chunked_cross_entropy
from engine.parallel.mesh import batch_mesh, context_mesh
from engine.parallel.pipeline_parallel import (
    WIDTH_BUCKET,
    PipelineModel,
    norm_parameters,
    pipeline_grad_norm,
    stack_micro_batches,
    with_batch_index,
)
from engine.parallel.tensor_parallel import vocab_parallel_cross_entropy
from engine.train.batches import MicroBatch
from engine.train.optim import total_grad_norm


@dataclasses.dataclass
class Losses:
    """A step's losses on this rank, fp32 0-d tensors summed over its micro-batches: ``token_sum`` (summed token
    cross-entropy; lm loss = token_sum / labelled tokens) and ``extra`` named terms."""

    token_sum: torch.Tensor
    extra: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    stats: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # reported sums, not differentiated

    def add(self, other: Losses) -> None:
        self.token_sum = self.token_sum + other.token_sum.detach()
        for terms, more in ((self.extra, other.extra), (self.stats, other.stats)):
            for name, value in more.items():
                terms[name] = terms.get(name, torch.zeros_like(value)) + value.detach()

    def objective(self, token_weight: torch.Tensor, loss_scale: float) -> torch.Tensor:
        """What backward differentiates: token_sum × (loss scale / global token count) + loss scale × extra terms."""
        out = self.token_sum * token_weight
        for value in self.extra.values():
            out = out + value * loss_scale
        return out

    def stacked(self) -> torch.Tensor:
        """[token_sum, extra values by name, stats by name] as one tensor, so a reduction is one collective."""
        named = [*(self.extra[k] for k in sorted(self.extra)), *(self.stats[k] for k in sorted(self.stats))]
        return torch.stack([self.token_sum.float(), *(v.float() for v in named)])

    def unstacked(self, values: torch.Tensor) -> Losses:
        n = len(self.extra)
        extra = {k: values[i + 1] for i, k in enumerate(sorted(self.extra))}
        return Losses(values[0], extra, {k: values[n + i + 1] for i, k in enumerate(sorted(self.stats))})


MicroBatchLoss = Callable[[nn.Module, MicroBatch], Losses]


class StepRunner(Protocol):
    """What the training loop needs from a rank's model, for any layout."""

    @property
    def module(self) -> nn.Module:
        """This rank's parameters under native FQNs (optimizer, DCP checkpoints)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks that share one step's micro-batches."""

    def forward_backward(
        self, batches: Sequence[MicroBatch], denominator: torch.Tensor, loss_scale: float
    ) -> Losses: ...

    def forward_only(self, batches: Sequence[MicroBatch]) -> Losses: ...

    def grad_norm(self) -> torch.Tensor: ...

    def reduce(self, losses: Losses) -> Losses: ...


def lm_loss(vocab_parallel: bool, chunk_size: int) -> MicroBatchLoss:
    """The language-model loss of one micro-batch: summed token CE (fp32), never materialising (tokens × vocab)."""

    def loss(model: nn.Module, mb: MicroBatch) -> Losses:
        return Losses(micro_batch_loss(model, mb, chunk_size, vocab_parallel))

    return loss


def micro_batch_loss(model: nn.Module, mb: MicroBatch, chunk_size: int, vocab_parallel: bool = False) -> torch.Tensor:
    """Sum of the token losses of one micro-batch (fp32 scalar). ``vocab_parallel``: the head is vocab-sharded
    over TP (and the hidden states may be sequence-sharded)."""
    hidden = model(
        mb.input_ids, position_ids=mb.position_ids, segment_ids=mb.segment_ids, return_hidden=True, counted=mb.counted
    )
    head = decoder_lm(model).output_weight()  # (V, H), or its vocab shard (a DTensor) under TP
    if vocab_parallel:
        return vocab_parallel_cross_entropy(hidden, head, mb.labels, chunk_size, mb.loss_index)[0]
    # Only rows with a label go through the head: the indices were computed on the host, so no device sync here.
    rows = hidden.flatten(0, 1).index_select(0, mb.loss_index)  # (N, H)
    loss_sum, _ = chunked_cross_entropy(rows, head, mb.loss_labels, chunk_size)
    return loss_sum


def _zeros(device: torch.device) -> Losses:
    return Losses(torch.zeros((), dtype=torch.float32, device=device))


class ModuleRunner:
    """Plain / FSDP2 / TP execution: micro-batches one after another through one module."""

    def __init__(
        self, module: nn.Module, device: torch.device, dp_group: dist.ProcessGroup | None, loss_fn: MicroBatchLoss
    ) -> None:
        self.module, self.device, self.dp_group, self.loss_fn = module, device, dp_group, loss_fn

    def forward_backward(self, batches: Sequence[MicroBatch], denominator: torch.Tensor, loss_scale: float) -> Losses:
        total = _zeros(self.device)
        weight = loss_scale / denominator
        for mb in batches:
            part = self.loss_fn(self.module, mb.to(self.device))
            part.objective(weight, loss_scale).backward()
            total.add(part)
        return total

    def forward_only(self, batches: Sequence[MicroBatch]) -> Losses:
        total = _zeros(self.device)
        for mb in batches:
            total.add(self.loss_fn(self.module, mb.to(self.device)))
        return total

    def grad_norm(self) -> torch.Tensor:
        return total_grad_norm([p for p in self.module.parameters() if p.requires_grad])

    def reduce(self, losses: Losses) -> Losses:
        values = losses.stacked()
        dist.all_reduce(values, group=self.dp_group)
        return losses.unstacked(values)


class PipelineLoss(Protocol):
    """A last-stage loss other than the token CE (stage dpo's ``engine.train.dpo.PipelineDPOLoss``): ``begin`` gets
    the step's micro-batches, each call one micro-batch's hidden states, padded labels, the head and the micro-batch's
    index (a call may repeat: the schedule's metadata inference); ``stats`` the step's summed figures."""

    @property
    def stats(self) -> dict[str, torch.Tensor]: ...

    def begin(self, batches: Sequence[MicroBatch], device: torch.device) -> None: ...

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, head: torch.Tensor, index: int) -> torch.Tensor: ...


class PipelineRunner:
    """Pipeline execution: the schedule runs every micro-batch through this rank's stages; the loss exists on the
    last stage (``make_loss_fn``, chunked as ``cross_entropy_chunk_size`` says) and is brought to every PP rank by
    ``reduce``. Extra loss terms are not carried through the schedule; MoE's load-balancing loss needs none: each MoE
    layer attaches its gradient in the stage's own graph (``engine.model.moe.AuxLossScaler``), weighted per micro-batch
    by its routed tokens (``RouterTracker.set_token_weight``)."""

    def __init__(self, module: PipelineModel, mesh: DeviceMesh, loss: PipelineLoss | None = None) -> None:
        self.module, self.mesh, self.loss = module, mesh, loss
        self.pipeline = module.pipeline
        self.pipeline.use_loss(loss)
        self.dp_group = batch_mesh(mesh).get_group()  # DP (× CP): the ranks holding different tokens
        self.context = context_mesh(mesh) is not None
        first = next(iter(self.pipeline.parts[0].parameters()))
        self.device = (first.to_local() if hasattr(first, "to_local") else first).device

    def forward_backward(self, batches: Sequence[MicroBatch], denominator: torch.Tensor, loss_scale: float) -> Losses:
        normaliser = float(denominator) / loss_scale
        total = self._run(batches, normaliser, train=True) * normaliser
        return Losses(total, stats=self._stats())

    def forward_only(self, batches: Sequence[MicroBatch]) -> Losses:
        return Losses(self._run(batches, 1.0, train=False), stats=self._stats())

    @contextlib.contextmanager
    def using(self, loss: PipelineLoss) -> Iterator[None]:
        """Run with ``loss`` on the last stage for a while (a pass over the data before training), then with this
        runner's own again."""
        previous, self.loss = self.loss, loss
        self.pipeline.use_loss(loss)
        try:
            yield
        finally:
            self.loss = previous
            self.pipeline.use_loss(previous)

    def _stats(self) -> dict[str, torch.Tensor]:
        """The custom loss's summed stats (zeros on the stages that compute none), else none."""
        return {} if self.loss is None else dict(self.loss.stats)

    def _run(self, batches: Sequence[MicroBatch], normaliser: float, train: bool) -> torch.Tensor:
        """The sum over micro-batches of (token loss / normaliser): the last stage's, zeros elsewhere."""
        longest = max(mb.input_ids.shape[1] for mb in batches)
        width = min(self.module.width, -(-longest // WIDTH_BUCKET) * WIDTH_BUCKET)  # few shapes -> few schedules
        if self.context:  # CP shards were cut from rows of one width already (``context_pipeline_width``)
            width = longest
        ids, labels, pos, seg, counted = stack_micro_batches(batches, width)
        if self.loss is not None:
            self.loss.begin(batches, self.device)
            labels = with_batch_index(labels, len(batches))
        ids, labels, pos = ids.to(self.device), labels.to(self.device), pos.to(self.device)
        seg = None if seg is None else seg.to(self.device)
        counted = None if counted is None else counted.to(self.device)
        out = self.pipeline.step(ids, labels, pos, seg, normaliser, train=train, counted=counted)
        return out.to(self.device, torch.float32)

    def grad_norm(self) -> torch.Tensor:
        # Per-stage norms (a tied embedding's last-stage copy not counted) combined over the stages.
        return pipeline_grad_norm(total_grad_norm(norm_parameters(self.pipeline.parts)), self.pipeline.pp_mesh)

    def reduce(self, losses: Losses) -> Losses:
        values = losses.stacked()
        dist.all_reduce(values, group=self.dp_group)
        dist.all_reduce(values, group=self.pipeline.pp_mesh.get_group())  # only the last stage's are non-zero
        return losses.unstacked(values)


def make_runner(
    module: nn.Module,
    mesh: DeviceMesh,
    device: torch.device,
    chunk_size: int,
    loss_fn: MicroBatchLoss | None = None,
    pipeline_loss: PipelineLoss | None = None,
) -> StepRunner:
    """The runner for the layout of ``mesh``: pipeline stages under PP > 1 (``module`` from ``build_pipeline_model``)
    with ``pipeline_loss`` (preference training) or the token CE on the last stage; else one module, with ``loss_fn``
    (preference training) or the LM loss (vocab-parallel under TP > 1)."""
    if mesh["pp"].size() > 1:
        if not isinstance(module, PipelineModel):
            raise TypeError("pipeline_model_parallel_size > 1 needs the stages built by build_pipeline_model")
        return PipelineRunner(module, mesh, pipeline_loss)
    loss_fn = loss_fn or lm_loss(mesh["tp"].size() > 1, chunk_size)
    return ModuleRunner(module, device, batch_mesh(mesh).get_group(), loss_fn)
