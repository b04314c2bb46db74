"""Pipeline parallelism with ``torch.distributed.pipelining`` (torchtitan ``distributed/pipeline_parallel.py``).

- Split: stage s holds global layers by an even split or an explicit ``num_layer_list``; with virtual stages
  (``num_layers_per_virtual_pipeline_stage`` = Lv) rank p holds the chunks v = 0.. of stage index v·PP + p, i.e.
  global layers [(v·PP + p)·Lv, (v·PP + p + 1)·Lv) — Megatron's interleaved layout. A stage is a model part
  holding only its own layers (modules taken from the meta-built model, never copied); layers stay keyed by their
  global index, so state-dict keys stay native.
- The embedding lives on the first stage, the final norm and the head on the last. A tied model's last stage gets
  its own ``output_layer`` initialised from the embedding (Megatron's ``setup_embeddings_and_output_layer``); both
  copies get the all-reduced sum of their gradients before the optimizer step (Megatron's embedding group), so
  they stay equal. Checkpoints never store the copy (``dcp_state_view``).
- Schedules: ``Schedule1F1B`` (one stage per rank) and ``ScheduleInterleaved1F1B`` (virtual stages), with
  ``scale_grads=False``: the loss of every micro-batch is divided by the global token count of the whole step
  (all micro-batches, all DP ranks) *before* backward, on the last stage, so the gradient every stage receives is
  already normalised (the per-micro-batch mean + 1/n scaling of the default would weight micro-batches wrongly).
- Activations crossing stages are plain local tensors: with sequence parallelism each TP rank sends its own
  sequence shard (Megatron does the same), re-wrapped as a ``Shard(1)`` DTensor on the next stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, TypeGuard, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from engine.contract import layout
from engine.contract.constants import IGNORE_INDEX, PAD_ID
from engine.contract.model_config import ModelConfig
from engine.contract.spec import TrainSpec
from engine.model.loss import chunked_cross_entropy
from engine.model.moe import paused_router_stats
from engine.parallel.tensor_parallel import dcp_view, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from engine.model.qwen3 import Qwen3Model

WIDTH_BUCKET = 64  # micro-batch widths under PP are rounded up to this many tokens

StageLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class StepNorm(TypedDict, total=False):
    """What the last stage's loss reads from the step: set by the pipeline, read inside the schedule."""

    tokens: float  # the step's global token count (the loss's divisor)
    loss: StageLoss | None  # a stage loss replacing the token CE (``Pipeline.use_loss``)
    shape: tuple[int, ...] | None  # the tied embedding's local gradient shape, asked once


class StageBatch(Protocol):
    """A micro-batch as the pipeline stacks it (``engine.train.batches.MicroBatch``)."""

    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def labels(self) -> torch.Tensor: ...
    @property
    def position_ids(self) -> torch.Tensor: ...
    @property
    def segment_ids(self) -> torch.Tensor | None: ...
    @property
    def counted(self) -> torch.Tensor | None: ...


# ids, labels, positions, segment ids (packed rows), counted tokens (context parallelism's padding)
StackedBatches = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def stage_layers(
    num_layers: int, pp: int, num_layer_list: Sequence[int] | None = None, layers_per_virtual_stage: int | None = None
) -> list[list[int]]:
    """Global layer indices of every pipeline stage, in stage order (len = PP × virtual chunks); LayoutError
    (``engine.contract.layout``) when the layers cannot be split so."""
    layout.check(
        layout.Shape(num_layers=num_layers),
        layout.ParallelDims(pp=pp),
        list(num_layer_list) if num_layer_list is not None else None,
        layers_per_virtual_stage,
    )
    if num_layer_list is not None:
        counts = list(num_layer_list)
    else:
        per = layers_per_virtual_stage or num_layers // pp
        counts = [per] * (num_layers // per)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [list(range(s, s + c)) for s, c in zip(starts, counts, strict=True)]


def build_stage_module(model: Qwen3Model, layers: Sequence[int], first: bool, last: bool) -> Qwen3Model:
    """A model part holding ``model``'s own ``layers`` (and the embedding / final norm + head where they belong).

    Nothing is copied: the part takes the modules themselves (``model`` is a shell afterwards, normally a meta-built
    one), so splitting never holds the model twice."""
    with torch.device("meta"):
        part = type(model)(model.cfg, layers=(), embedding=False, head=False)
    for i in layers:
        part.decoder.layers[str(i)] = model.decoder.layers[str(i)]
    if first:
        part.embedding = model.embedding
    if last:
        part.decoder.final_layernorm = model.decoder.final_layernorm
        part.output_layer = model.output_layer
        if part.output_layer is None and not first:
            # Tied model, head on another rank than the embedding: an own copy, kept in sync by its gradients.
            assert model.embedding is not None  # the whole model holds the embedding
            weight = model.embedding.word_embeddings.weight
            part.output_layer = nn.Linear(
                weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype
            )
            if weight.device.type != "meta":
                with torch.no_grad():
                    part.output_layer.weight.copy_(weight)
            part.output_layer.weight.requires_grad_(weight.requires_grad)
    return part


class StageModule(nn.Module):
    """What ``PipelineStage`` runs: the model part, with DTensor <-> local conversion at the stage boundary."""

    def __init__(self, part: nn.Module, sequence_parallel_mesh: DeviceMesh | None) -> None:
        super().__init__()
        self.part = part
        self.sp_mesh = sequence_parallel_mesh
        # The schedule's first forward of a stage is PipelineStage's shape inference (on the first micro-batch's
        # shapes, empty tensors past the first stage), not a micro-batch: MoE router figures must not count it.
        self.inferred = False

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        counted: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.sp_mesh is not None and self.part.embedding is None:  # x: this rank's sequence shard
            x = sequence_shard(x, self.sp_mesh, position_ids.shape[1])
        with contextlib.nullcontext() if self.inferred else paused_router_stats(self.part):
            self.inferred = True
            out = self.part(x, position_ids=position_ids, segment_ids=segment_ids, return_hidden=True, counted=counted)
        return out.to_local() if isinstance(out, DTensor) else out


def sequence_shard(local: torch.Tensor, tp_mesh: DeviceMesh, seq_len: int) -> DTensor:
    """This TP rank's (B, T_k, H) sequence shard as the ``Shard(1)`` DTensor of the (B, seq_len, H) activation; the
    global shape is given explicitly because T need not divide evenly by TP (packed rows)."""
    b, _, h = local.shape
    return DTensor.from_local(
        local, tp_mesh, [Shard(1)], run_check=False, shape=torch.Size((b, seq_len, h)), stride=(seq_len * h, h, 1)
    )


@dataclasses.dataclass
class Pipeline:
    """This rank's stages and the schedule that runs one global step's micro-batches through them.

    Stages exchange activations of a shape fixed when a ``PipelineStage`` first runs, so one set of stages and
    schedule is built per micro-batch shape (``make_schedule``) and kept: with variable sequence lengths the
    trainer pads each step to a bucketed width, so only a few shapes ever occur."""

    parts: list[Qwen3Model]  # model parts in stage order (native FQNs), for the optimizer / checkpoints
    make_schedule: Callable[[], _PipelineSchedule]
    is_first: bool
    is_last: bool
    pp_mesh: DeviceMesh
    _norm: StepNorm = dataclasses.field(default_factory=lambda: StepNorm())
    # one schedule per (micro-batch shape, packed, counted)
    _schedules: dict[tuple[tuple[int, ...], bool, bool], _PipelineSchedule] = dataclasses.field(default_factory=dict)

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def use_loss(self, loss: StageLoss | None) -> None:
        """The last stage's loss instead of the token CE from now on: ``(hidden, labels, head, index) -> loss``
        (``make_loss_fn`` divides it by the step's normaliser); None: the token CE again."""
        self._norm["loss"] = loss

    def step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        segment_ids: torch.Tensor | None,
        normaliser: float,
        train: bool = True,
        counted: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward + backward of all micro-batches (stacked on dim 0); every micro-batch's summed token loss is
        divided by ``normaliser`` (the step's global token count) before backward. Returns the sum of those
        divided losses (non-zero on the last stage only). ``train=False`` runs the forward passes only."""
        self._norm["tokens"] = float(max(normaliser, 1e-12))
        kwargs: dict[str, Any] = {"position_ids": position_ids}
        if segment_ids is not None:
            kwargs["segment_ids"] = segment_ids
        if counted is not None:  # (rows, T) bool: the tokens MoE routing counts (context parallelism's padding not)
            kwargs["counted"] = counted
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.is_first else ()
        target = labels if self.is_last else None
        key = (tuple(input_ids.shape), segment_ids is not None, counted is not None)
        if key not in self._schedules:
            self._schedules[key] = self.make_schedule()
        if train:
            # return_outputs=False: the last stage would keep every micro-batch's output (its final hidden states)
            # until the step ends, only to concatenate them for a return value nobody reads: GBS / MBS of them held
            # at once (640 MiB for Qwen3-32B TP4 PP2 SP at GBS 64), which no fixed micro-batch count bounds
            self._schedules[key].step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
            sync_tied_grads(self)
        else:  # forward only (torch.distributed.pipelining switches the stages to eval and back by itself)
            self._schedules[key].eval(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if not self.is_last:  # on the device, as the last stage's sum is: no host tensor inside the step
            return torch.zeros((), device=input_ids.device)
        return torch.stack([loss.detach() for loss in losses]).sum()


def make_loss_fn(
    last_part: Qwen3Model | None,
    norm: StepNorm,
    tp_mesh: DeviceMesh | None,
    sequence_parallel: bool,
    chunk_size: int = 256,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Loss of one micro-batch on the last stage: summed token CE / global token count (before backward), the head
    applied ``chunk_size`` tokens at a time (``cross_entropy_chunk_size``, as without PP). ``norm["loss"]``, when
    set, replaces the token CE: ``(hidden, labels, head, micro-batch index) -> summed loss`` (stage dpo's per-pair
    loss); the labels then carry the micro-batch's index in a last column (``with_batch_index``): the schedule also
    calls the loss once outside the step's order, to infer backward metadata, so the order of calls cannot tell."""

    def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert last_part is not None  # the schedule calls loss_fn on the last stage only
        weight = last_part.output_weight()
        custom = norm.get("loss")
        index = 0
        if custom is not None:
            index, labels = int(labels[0, -1]), labels[:, :-1]
        if isinstance(weight, DTensor) and sequence_parallel:
            assert tp_mesh is not None  # sequence parallelism runs over the TP mesh
            hidden = sequence_shard(hidden, tp_mesh, labels.shape[1])
        if custom is not None:
            return custom(hidden, labels, weight, index) / norm["tokens"]
        if isinstance(weight, DTensor):
            loss_sum, _ = vocab_parallel_cross_entropy(hidden, weight, labels, chunk_size)
        else:  # only labelled rows reach the head (padding to the pipeline width costs nothing there)
            flat = labels.reshape(-1)
            rows = (flat != IGNORE_INDEX).nonzero().squeeze(1)
            h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
            loss_sum, _ = chunked_cross_entropy(h, weight, flat.index_select(0, rows), chunk_size)
        return loss_sum / norm["tokens"]

    return loss_fn


def build_pipeline(
    model: Qwen3Model,
    pp_mesh: DeviceMesh,
    n_microbatches: int,
    *,
    num_layer_list: Sequence[int] | None = None,
    layers_per_virtual_stage: int | None = None,
    parallelize_part: Callable[[nn.Module], nn.Module] = lambda part: part,
    tp_mesh: DeviceMesh | None = None,
    sequence_parallel: bool = False,
    device: torch.device | None = None,
    loss_chunk_size: int = 256,
) -> Pipeline:
    """Split ``model`` for this PP rank, parallelize each part (TP/AC/FSDP via ``parallelize_part``), build the
    schedule. ``model`` is the whole model, normally built on the meta device (each rank keeps only its parts, to be
    ``to_empty``'d and filled afterwards); ``device`` is where the stages will run (default: the parameters')."""
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    stages = stage_layers(model.cfg.num_layers, pp, num_layer_list, layers_per_virtual_stage)
    n_stages = len(stages)
    if n_stages > pp and n_microbatches % pp:
        raise ValueError(
            f"global_batch_size: the interleaved schedule needs the micro-batch count ({n_microbatches}) to be a "
            f"multiple of PP ({pp})"
        )
    stage_ids = list(range(rank, n_stages, pp))
    parts = [build_stage_module(model, stages[s], s == 0, s == n_stages - 1) for s in stage_ids]
    parts = [cast("Qwen3Model", parallelize_part(p)) for p in parts]  # FSDP/TP keep the class (a subclass)
    sp_mesh = tp_mesh if sequence_parallel and tp_mesh is not None and tp_mesh.size() > 1 else None
    group = pp_mesh.get_group()
    device = device or _local(next(iter(parts[0].parameters()))).device
    last_part = parts[-1] if stage_ids[-1] == n_stages - 1 else None
    norm = StepNorm(tokens=1.0)  # set by every step before the schedule runs
    loss_fn = make_loss_fn(last_part, norm, tp_mesh, sp_mesh is not None, loss_chunk_size)

    def make_schedule() -> _PipelineSchedule:
        # imported here, not at the top: torch.distributed.pipelining brings torch._dynamo and sympy (~0.7 s of CPU
        # per process), which every engine process imported through this module though only PP > 1 runs a schedule
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        stages = [
            PipelineStage(StageModule(part, sp_mesh), s, n_stages, device, group=group)
            for part, s in zip(parts, stage_ids, strict=True)
        ]
        if n_stages == pp:
            return Schedule1F1B(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
        # torch annotates the stages as an (invariant) list of its private base class; PipelineStage is one
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)  # type: ignore[arg-type]

    return Pipeline(parts, make_schedule, 0 in stage_ids, n_stages - 1 in stage_ids, pp_mesh, norm)


# ------------------------------------------------------------------ tied embedding group


def _tied_weights(pipe: Pipeline) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for part in pipe.parts:
        if part.embedding is not None and part.cfg.tie_word_embeddings:
            out.append(part.embedding.word_embeddings.weight)
        if part.output_layer is not None and _has_copy(part):
            out.append(part.output_layer.weight)
    return out


def sync_tied_grads(pipe: Pipeline) -> None:
    """All-reduce (sum) the gradients of the tied embedding and its last-stage copy (Megatron's embedding group).

    Every PP rank takes part (the others contribute zeros): one group, no extra sub-groups to create."""
    model_cfg = pipe.parts[0].cfg
    if not model_cfg.tie_word_embeddings or pipe.pp_mesh.size() == 1:
        return
    tied = _tied_weights(pipe)
    if len(tied) > 1:
        raise RuntimeError("tied embedding: a rank holds both the embedding and its copy; use PP > 1 stages")
    ref = tied[0] if tied else None
    if isinstance(ref, DTensor) and isinstance(ref.grad, DTensor) and ref.grad.placements != ref.placements:
        # PyTorch's vocab-parallel embedding backward yields a replicated (full) gradient: take this rank's rows.
        ref.grad = ref.grad.redistribute(placements=ref.placements)
    shape = _local_embedding_shape(pipe, ref)
    if shape is None:  # frozen (LoRA): no gradient, and a zero buffer would be a full fp32 embedding per rank
        return
    if ref is not None and ref.grad is not None:
        buf = _local(ref.grad).clone()
    else:
        device = _local(next(iter(pipe.parts[0].parameters()))).device  # nccl/hccl need device tensors
        buf = torch.zeros(shape, device=device)
    dist.all_reduce(buf, group=pipe.pp_mesh.get_group())
    if ref is not None and ref.grad is not None:
        _local(ref.grad).copy_(buf)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_embedding_shape(pipe: Pipeline, ref: torch.Tensor | None) -> tuple[int, ...] | None:
    """The local gradient shape of the tied weight (the same on its two holders), None when it is frozen; asked
    once, then cached."""
    if "shape" not in pipe._norm:
        shapes: list[tuple[int, ...] | None] = [None] * pipe.pp_mesh.size()
        mine = None if ref is None or not ref.requires_grad else tuple(_local(ref).shape)
        dist.all_gather_object(shapes, mine, group=pipe.pp_mesh.get_group())
        pipe._norm["shape"] = next((s for s in shapes if s is not None), None)
    return pipe._norm["shape"]


def _has_copy(part: nn.Module) -> bool:
    """Whether ``part`` (a stage, a ``PipelineModel`` or a whole model) holds a tied embedding's copy: a tied model
    has no output layer of its own, so any it holds is the last stage's copy (read from the structure, not a mark)."""
    cfg = getattr(part, "cfg", None)
    return bool(cfg is not None and cfg.tie_word_embeddings and getattr(part, "output_layer", None) is not None)


def norm_parameters(parts: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Trainable parameters that count in the global grad norm: all but a tied embedding's last-stage copy
    (Megatron counts the shared embedding once)."""
    skip = {id(cast(nn.Linear, part.output_layer).weight) for part in parts if _has_copy(part)}
    return [p for part in parts for p in part.parameters() if p.requires_grad and id(p) not in skip]


def pipeline_grad_norm(local_norm: torch.Tensor, pp_mesh: DeviceMesh) -> torch.Tensor:
    """Combine per-stage gradient norms (already reduced over DP/TP) into the global norm over every stage."""
    if pp_mesh.size() == 1:
        return local_norm
    sq = local_norm.detach().float().pow(2).reshape(())
    dist.all_reduce(sq, group=pp_mesh.get_group())
    return sq.sqrt()


_COPY_KEY, _NATIVE_KEY = "output_layer.weight", "embedding.word_embeddings.weight"


def dcp_state_view(
    state: dict[str, Any],  # Any: a model + optimizer state tree (tensors, numbers, FQN lists), as DCP types it
    modules: nn.Module | Sequence[nn.Module],
    mode: str,
) -> tuple[dict[str, Any], Callable[[], dict[str, Any]]]:  # Any: state trees as above
    """A (nested or flattened) model + optimizer state dict as DCP must see it on this rank, and ``finish()``.

    - A tied model's last-stage ``output_layer`` copy is not a native tensor: on save it is left out (the embedding
      holds the same values), on load it reads the embedding's entries (weight and optimizer state). So checkpoints
      saved under any PP layout, or without PP, restore the copy exactly.
    - TP's strided fc1 shards are presented as plain shards of the same global tensor (``dcp_view``).
    Save: pass the view to ``dcp.save``. Load: ``dcp.load`` the view, then ``finish()`` returns ``state`` with the
    loaded values (tensors are filled in place; plain values such as learning rates come from the view)."""
    if mode not in ("save", "load"):
        raise ValueError(f"mode: expected 'save' or 'load', got {mode!r}")
    parts = [modules] if isinstance(modules, nn.Module) else list(modules)
    copy_here = any(_has_copy(m) for m in parts)

    def is_copy(name: object) -> TypeGuard[str]:
        return copy_here and isinstance(name, str) and _COPY_KEY in name

    def rename(obj: object) -> object:
        if isinstance(obj, dict):
            kept = {k: v for k, v in obj.items() if not (mode == "save" and is_copy(k))}
            return {(k.replace(_COPY_KEY, _NATIVE_KEY) if is_copy(k) else k): rename(v) for k, v in kept.items()}
        if isinstance(obj, list):
            kept_items = [v for v in obj if not (mode == "save" and is_copy(v))]
            return [v.replace(_COPY_KEY, _NATIVE_KEY) if is_copy(v) else rename(v) for v in kept_items]
        return obj

    renamed = rename(state)
    assert isinstance(renamed, dict)  # a dict renamed is a dict
    view, restore = dcp_view(renamed)

    def merge(original: object, loaded: object) -> object:
        if isinstance(original, dict):
            assert isinstance(loaded, dict)  # the view has the state's shape
            return {
                k: merge(v, loaded[_NATIVE_KEY.join(k.split(_COPY_KEY)) if is_copy(k) else k])
                for k, v in original.items()
            }
        if isinstance(original, list):
            names = any(isinstance(o, str) for o in original)
            if names or not isinstance(loaded, list) or len(loaded) != len(original):
                return original  # FQN lists (param_groups' "params") name this rank's parameters, not the saver's
            return [merge(o, l) for o, l in zip(original, loaded, strict=True)]
        if isinstance(original, (torch.Tensor, str)):
            return original  # tensors were loaded in place (or restored); FQN strings keep this rank's names
        return loaded

    def finish() -> dict[str, Any]:  # Any: the state tree, as DCP types it
        restore()
        merged = merge(state, view)
        assert isinstance(merged, dict)  # a dict merged is a dict
        return merged

    return view, finish


# ------------------------------------------------------------------ the trainer's view of a pipeline


class PipelineModel(nn.Module):
    """This rank's pipeline parts seen as one module with native FQNs (``embedding``, ``decoder.layers.<global i>``,
    ``decoder.final_layernorm``, ``output_layer``), so the optimizer, DCP checkpoints and export treat a pipeline
    rank like a model. The pipeline itself is not a submodule (its parts are registered through the attributes)."""

    pipeline: Pipeline  # set in __init__, outside nn.Module's registry

    def __init__(self, pipe: Pipeline, width: int) -> None:
        super().__init__()
        parts = pipe.parts
        self.cfg = parts[0].cfg
        self.embedding = next((p.embedding for p in parts if p.embedding is not None), None)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleDict({k: v for p in parts for k, v in p.decoder.layers.items()})
        self.decoder.register_module("final_layernorm", parts[-1].decoder.final_layernorm)
        self.output_layer = parts[-1].output_layer
        object.__setattr__(self, "pipeline", pipe)
        self.width = width  # the widest micro-batch a step can have; steps pad to a multiple of WIDTH_BUCKET

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("a pipeline rank runs through engine.train.step_runner.PipelineRunner, not forward()")


def stack_micro_batches(batches: Sequence[StageBatch], width: int) -> StackedBatches:
    """Micro-batches (``engine.train.batches.MicroBatch``) padded to ``width`` columns and stacked on dim 0:
    ids, labels, positions, segment ids and the tokens MoE routing counts (``counted``: (rows, width) bool when
    context parallelism padded any micro-batch itself, all True on the others; the pipeline pads none under CP).

    Padding: token 0, label -100, positions continuing, and (when any micro-batch is packed) the row's last
    segment id — pad tokens come after every real token, so under the causal mask no real token sees them."""
    packed = any(mb.segment_ids is not None for mb in batches)
    with_counted = any(mb.counted is not None for mb in batches)
    ids, labels, pos, seg, counted = [], [], [], [], []
    for mb in batches:
        rows, t = mb.input_ids.shape
        if t > width:
            raise ValueError(f"seq_length: a micro-batch has {t} tokens per row, more than the pipeline width {width}")
        extra = width - t
        ids.append(F.pad(mb.input_ids, (0, extra), value=PAD_ID))
        labels.append(F.pad(mb.labels, (0, extra), value=IGNORE_INDEX))
        pos.append(torch.cat([mb.position_ids, mb.position_ids[:, -1:] + torch.arange(1, extra + 1)], dim=1))
        if packed:
            s = mb.segment_ids if mb.segment_ids is not None else torch.zeros(rows, t, dtype=torch.int32)
            seg.append(torch.cat([s, s[:, -1:].expand(rows, extra)], dim=1))
        if with_counted:
            c = mb.counted if mb.counted is not None else torch.ones(t, dtype=torch.bool)
            counted.append(F.pad(c, (0, extra), value=False).expand(rows, -1))
    return (
        torch.cat(ids),
        torch.cat(labels),
        torch.cat(pos),
        torch.cat(seg) if packed else None,
        torch.cat(counted) if with_counted else None,
    )


def with_batch_index(labels: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """Stacked labels with each row's micro-batch index appended as a last column (see ``make_loss_fn``)."""
    rows = labels.shape[0] // micro_batches
    index = torch.arange(micro_batches, dtype=labels.dtype, device=labels.device).repeat_interleave(rows)
    return torch.cat([labels, index[:, None]], dim=1)


def pipeline_width(seq_length: int, micro_batch_size: int, padding_free: bool) -> int:
    """Columns of every micro-batch under PP: one packed row of ``micro_batch_size`` samples, or one padded row per
    sample (samples are shifted, so a sample has at most seq_length - 1 tokens)."""
    return micro_batch_size * (seq_length - 1) if padding_free else seq_length - 1


# ------------------------------------------------------------------ spec -> pipeline (the trainer's entry points)


def check_parallel_layout(spec: TrainSpec, cfg: ModelConfig, dims: layout.ParallelDims, global_batch_size: int) -> None:
    """BadInput (naming the flag) for a TP/PP layout this model and batch cannot use; run before any work."""
    from engine.contract.runfiles import BadInput

    vpp = spec.num_layers_per_virtual_pipeline_stage
    if vpp is not None and dims.pp == 1:
        raise BadInput(
            "num_layers_per_virtual_pipeline_stage: needs pipeline_model_parallel_size > 1",
            "num_layers_per_virtual_pipeline_stage",
        )
    try:
        layout.check(cfg, dims, spec.num_layer_list, vpp)
    except layout.LayoutError as err:
        raise BadInput(str(err), err.field) from err
    stages = stage_layers(cfg.num_layers, dims.pp, spec.num_layer_list, vpp)
    n_micro = global_batch_size // (spec.micro_batch_size * dims.dp)
    if dims.pp > 1 and n_micro < dims.pp:
        raise BadInput(
            f"global_batch_size: 1F1B needs at least PP ({dims.pp}) micro-batches per step; global_batch_size / "
            f"(micro_batch_size × DP) = {n_micro}",
            "global_batch_size",
        )
    if len(stages) > dims.pp and n_micro % dims.pp:
        raise BadInput(
            f"global_batch_size: the interleaved schedule needs the number of micro-batches (global_batch_size / "
            f"(micro_batch_size × DP) = {n_micro}) to be a multiple of PP ({dims.pp})",
            "global_batch_size",
        )


def build_pipeline_model(
    model: nn.Module,
    mesh: DeviceMesh,
    spec: TrainSpec,
    global_batch_size: int,
    seq_length: int,
    parallelize_part: Callable[[nn.Module], nn.Module],
    device: torch.device | None = None,
) -> PipelineModel:
    """This rank's stages of ``model`` (split by the spec's PP flags), parallelized and scheduled."""
    dp = mesh["dp"].size()
    pipe = build_pipeline(
        cast("Qwen3Model", model),
        mesh["pp"],
        global_batch_size // (spec.micro_batch_size * dp),
        num_layer_list=spec.num_layer_list,
        layers_per_virtual_stage=spec.num_layers_per_virtual_pipeline_stage,
        parallelize_part=parallelize_part,
        tp_mesh=mesh["tp"],
        sequence_parallel=bool(spec.sequence_parallel),
        device=device,
        loss_chunk_size=getattr(spec, "cross_entropy_chunk_size", 256),
    )
    return PipelineModel(pipe, pipeline_width(seq_length, spec.micro_batch_size, bool(spec.padding_free)))
