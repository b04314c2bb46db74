"""One rank's training step on fake tensors: built and run by the trainer's own code, measured by ``MemTracker``.

The rank joins torch's fake process group (``fake_pg``: every collective returns at once, any world size in one
process), builds the job's dp × (cp ×) pp × tp mesh on the device type, then, under ``FakeTensorMode``, the model
(``build_rank_model`` with no weights to read), its step runner, optimizer and LR schedule, exactly as
``engine.train.job.Trainer`` does, and runs one step at the worst-case micro-batch: every micro-batch of the rank
(``global_batch_size / (micro_batch_size × DP)``) holds ``micro_batch_size`` samples of ``seq_length`` tokens.
The step is ``engine.train.loop.train_step`` without its one host sync (the grad-norm finiteness check, which a fake
tensor cannot answer): counts all-reduce, forward/backward through the runner (the pipeline schedule under PP),
context/expert gradient reduction, grad norm, clipping, ``optimizer.step()``, scheduler step, ``zero_grad``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch._guards import active_fake_mode
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from typing_extensions import Self

from engine.contract.layout import ParallelDims
from engine.contract.model_config import ModelConfig
from engine.contract.spec import TrainSpec
from engine.load.rank_model import build_rank_model
from engine.parallel.device import Device
from engine.parallel.expert_parallel import reduce_over_context
from engine.parallel.mesh import build_mesh, context_mesh
from engine.parallel.parallelize import compute_dtype
from engine.trace.shims import (
    SegmentOracle,
    fake_activations_freed,
    fake_pipeline_peers,
    host_attention_plans,
    host_batch_staging,
    host_mesh_coordinates,
    local_tied_shape,
    sharding_propagation_paused,
    swappable_fake_parameters,
)
from engine.train.batches import (
    MicroBatch,
    Sample,
    collate,
    collate_pairs,
    context_pipeline_width,
    context_shard,
)
from engine.train.loop import _global_counts
from engine.train.optim import LossScaler, build_optimizer, clip_grads
from engine.train.router_stats import RouterTracker
from engine.train.schedule import Scheduler, schedule_from_spec
from engine.train.step_runner import MicroBatchLoss, PipelineRunner, make_runner

# MemTracker's kinds -> the names of the trace's breakdown (plan's parts where they match)
KINDS = {
    "Parameter": "params",
    "Buffer": "buffers",
    "Gradient": "grads",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "other",
}
_COLLECTIVES = {
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce",
    "alltoall": "all_to_all",
    "send": "send_recv",
    "recv": "send_recv",
    "broadcast": "broadcast",
    "all_gather": "all_gather",
    "all_reduce": "all_reduce",
    "all_to_all": "all_to_all",
}


@dataclasses.dataclass
class RankTrace:
    """What one rank's fake step measured (bytes)."""

    rank: int
    peak_bytes: int
    breakdown: dict[str, int]
    host_tensors: int
    host_ops: dict[str, int]
    host_syncs: dict[str, int]
    collective_bytes_per_step: dict[str, int]
    wall_s: float
    host_peak_bytes: int = 0  # the host's peak over the step: the offloaded optimizer state and its step's slices

    def as_json(self) -> dict[str, Any]:  # Any: JSON values the trace CLI reads back as numbers
        return dataclasses.asdict(self)


def _gone() -> None:  # a weak reference whose tensor is gone
    return None


class StepWatch(TorchDispatchMode):
    """Every op of the step: tensors it creates on the host (each one a host tensor the engine made inside the step,
    where everything should live on the device), and the bytes each collective moves (its input tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.host_ops: dict[str, int] = {}
        self.collectives: dict[str, int] = {}
        self._entry_mode: FakeTensorMode | None = None
        self._paused = False
        self.label_rows: int | None = None  # labelled tokens of a worst-case micro-batch (the oracle's answer)
        self.host_syncs: dict[str, int] = {}
        # (width, counted tokens per row) of the rank's CP shards that context parallelism padded, else None
        self.counted_row: tuple[int, int] | None = None
        # MoE: (EP degree, rows one MoE layer routes per forward: tokens × top-k, experts per EP rank), else None
        self.ep_rows: tuple[int, int, int] | None = None
        self._scalars: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._ep_sums: dict[int, weakref.ref[torch.Tensor]] = {}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The trace's own host work (``shims``) is not the step's; nests (DTensor's propagation inside a paused
        model build must not resume the watch when it ends)."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    def __enter__(self) -> Self:
        self._entry_mode = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: tuple[Any, ...] = (),  # Any: an op's arguments are whatever its schema takes (tensors, sizes, lists)
        kwargs: dict[str, Any] | None = None,  # Any: as args
    ) -> object:
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) in self._scalars:
            # a host read of a value the host batch gives (``_remember_counted_sum``, ``_remember_ep_splits``)
            ref, value = self._scalars[id(args[0])]
            if ref() is args[0]:
                self.host_syncs[str(func)] = self.host_syncs.get(str(func), 0) + 1
                return value
        if func is torch.ops.aten.bincount.default and self._counts_rows(args, kwargs or {}):
            # DPO's per-sequence token counts (``preference.sequence_logprobs``: ``bincount`` of each kept token's
            # row, all below ``minlength`` = the rows): the output's length is data, a device -> host sync
            self.host_syncs[str(func)] = self.host_syncs.get(str(func), 0) + 1
            minlength = args[2] if len(args) > 2 else (kwargs or {})["minlength"]
            return torch.empty((minlength,), dtype=torch.long, device=args[0].device)
        if func is torch.ops.aten.nonzero.default and self._answers(args[0]):
            # a device -> host sync in the engine (the output's length is data): answered from the host batch
            self.host_syncs[str(func)] = self.host_syncs.get(str(func), 0) + 1
            assert self.label_rows is not None
            return torch.empty((self.label_rows, 1), dtype=torch.long, device=args[0].device)
        out = func(*args, **(kwargs or {}))
        if (
            self._paused or active_fake_mode() is not self._entry_mode
        ):  # DTensor's sharding propagation, not the step's own ops
            return out
        if self.counted_row is not None and func.overloadpacket is torch.ops.aten.sum:
            self._remember_counted_sum(args, out)
        if self.ep_rows is not None:
            self._remember_ep_splits(func, args, out)
        name = func._schema.name.split("::")[-1]
        kind = next((k for key, k in _COLLECTIVES.items() if name.lstrip("_").startswith(key)), None)
        if func.namespace in ("c10d", "_c10d_functional") and kind is not None:
            sent = sum(t.numel() * t.element_size() for t in _tensors(args) if t.device.type != "cpu")
            self.collectives[kind] = self.collectives.get(kind, 0) + sent
        # ``torch.tensor(values, device=...)`` lifts a host literal before copying it: host values, not a host tensor
        if func is not torch.ops.aten.lift_fresh.default:
            for t in _tensors(out):
                if t.device.type == "cpu":
                    self.host_ops[str(func)] = self.host_ops.get(str(func), 0) + 1
        return out

    def _remember_counted_sum(self, args: tuple[Any, ...], out: torch.Tensor) -> None:  # Any: as dispatch's
        """A whole sum of a device ``counted`` mask (bool, rows of the shard's width): its value from the host."""
        mask: torch.Tensor = args[0]
        assert self.counted_row is not None
        width, per_row = self.counted_row
        whole = len(args) == 1 or args[1] is None
        if whole and mask.dtype == torch.bool and mask.device.type != "cpu" and mask.shape[-1] == width:
            self._scalars[id(out)] = (weakref.ref(out), mask.numel() // width * per_row)

    def _remember_ep_splits(
        self, func: OpOverload, args: tuple[Any, ...], out: torch.Tensor | Sequence[torch.Tensor]
    ) -> None:  # Any: as dispatch's
        """MoE's host reads of the routing, answered as balanced routing (each rank's ``rows``, tokens × top-k, split
        evenly over the EP ranks and the experts; the planner's assumption): expert parallelism's all-to-all splits
        (``AllToAllDispatch.dispatch``: ``counts.reshape(ep, local).sum(1).tolist()``, rows sent to and received from
        each EP rank, per MoE layer) and the padded expert kernel's busiest expert (``int(counts.max())``)."""
        assert self.ep_rows is not None
        ep, rows, local = self.ep_rows
        if func is torch.ops.aten.max.default:  # ``GroupedExperts``' padded kernel: the busiest local expert's rows
            counts = args[0]
            if (
                isinstance(out, torch.Tensor)
                and counts.dim() == 1
                and counts.shape[0] == local
                and counts.dtype == torch.long
            ):
                self._scalars[id(out)] = (weakref.ref(out), -(-rows // local))
        elif func is torch.ops.aten.sum.dim_IntList and ep > 1:
            counts = args[0]
            two_d = counts.dim() == 2 and counts.shape[0] == ep and counts.dtype == torch.long
            if isinstance(out, torch.Tensor) and two_d and list(args[1]) == [1]:
                self._ep_sums[id(out)] = weakref.ref(out)
        elif func is torch.ops.aten.unbind.int and self._ep_sums.get(id(args[0]), _gone)() is args[0]:
            for i, element in enumerate(out):  # the first ``rows % ep`` ranks take one row more
                self._scalars[id(element)] = (weakref.ref(element), rows // ep + (i < rows % ep))

    def _counts_rows(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:  # Any: as dispatch's
        minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
        weights = args[1] if len(args) > 1 else kwargs.get("weights")
        return bool(minlength) and weights is None and args[0].device.type != "cpu" and not self._paused

    def _answers(self, mask: torch.Tensor) -> bool:
        """A labelled-token mask of one micro-batch: the only data-dependent shape the oracle answers."""
        on_device = mask.device.type != "cpu"
        return (
            self.label_rows is not None
            and on_device
            and mask.dtype == torch.bool
            and mask.dim() == 1
            and not self._paused
        )


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK: Any = _NoHook()


class StepTracker(MemTracker):
    """MemTracker over a step that runs the rank's root module once per micro-batch: a root called again in forward
    starts a new module record (MemTracker refuses a second iteration); the device-wide peak spans them all.

    ``module_hooks=False`` (pipeline parallelism): no module hooks. ModTracker's hooks (a multi-grad hook on every
    module's inputs and outputs) abort the process in the pipeline stage's ``autograd.grad`` on the private-use
    device: the autograd worker thread fails, and unwinding calls the Python device guard from a ``noexcept``
    ``exchangeStream`` (``std::terminate``). Without them both stages trace; the stage's parameters and gradients
    are then registered by ``track_model`` (phase is told by the autograd graph task, as MemTracker does anyway)."""

    def __init__(self, module_hooks: bool = True) -> None:
        super().__init__()
        self.module_hooks = module_hooks

    def __enter__(self) -> Self:
        super().__enter__()
        if not self.module_hooks:
            self._mod_tracker.__exit__()  # the module hooks it just installed
        return self

    def __exit__(self, *args: object) -> None:
        if not self.module_hooks:
            self._mod_tracker.__enter__()  # MemTracker's exit removes them
        super().__exit__(*args)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # MemTracker hooks every parameter's gradient; a frozen one (LoRA's base) takes no hook: marked as hooked
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def track_model(self, model: nn.Module) -> None:
        """Parameters and their gradients counted as such where no module hook registers them."""
        if not self.module_hooks:
            self._track_module_params_and_buffers(model, install_grad_hooks=True)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:  # Any: as MemTracker's (a module's inputs)
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def restart_peak(self) -> None:
        """Measure the peak from here on (the steady-state step): the first step's optimizer creates Adam's state,
        and on fake tensors torch's in-place fused AdamW runs as its out-of-place form, whose copies of every state
        list (several times the state, transient) a device's in-place kernel never allocates."""
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}


def _tensors(tree: object) -> Iterator[torch.Tensor]:
    return (t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def worst_case_batches(spec: TrainSpec, cfg: ModelConfig, micro_batches: int, seed: int = 0) -> list[MicroBatch]:
    """The rank's micro-batches at the worst case: ``micro_batch_size`` samples of ``seq_length`` labelled tokens
    each, collated as the job collates (packed or padded), on the host as the data loader leaves them."""
    assert spec.seq_length is not None
    rng = np.random.default_rng(seed)
    out = []
    pairs = spec.stage == "dpo"  # a pair's chosen and rejected answers, each a whole sequence
    for _ in range(micro_batches):
        samples = []
        for _ in range(spec.micro_batch_size * (2 if pairs else 1)):
            ids = rng.integers(0, cfg.vocab_size, spec.seq_length, dtype=np.int64)
            samples.append(Sample(ids, ids.copy()))
        if pairs:  # the job's order: chosen_1, rejected_1, chosen_2, ...
            out.append(collate_pairs(samples, spec.seq_length, spec.variable_seq_lengths))
        else:
            out.append(collate(samples, spec.seq_length, spec.padding_free, spec.variable_seq_lengths))
    return out


def context_shards(batches: list[MicroBatch], dims: ParallelDims, mesh: DeviceMesh) -> list[MicroBatch]:
    """Under context parallelism the rank's share of every row, cut as the job cuts it (``Trainer._context_shards``:
    one row width for the pipeline's micro-batches under PP), whole rows otherwise. The model plans its attention
    for CP × the local width with the whole segment ids the shard carries."""
    if (cp := context_mesh(mesh)) is None:
        return batches
    ring, ulysses = dims.ring_degree, dims.ulysses_degree
    width = None if dims.pp == 1 else context_pipeline_width(batches, ring, ulysses)
    return [context_shard(mb, ring, ulysses, cp.get_local_rank(), width) for mb in batches]


def _preference_loss(
    spec: TrainSpec, cfg: ModelConfig, mesh: DeviceMesh, model: nn.Module, gbs: int, device: Device
) -> MicroBatchLoss | None:
    """Stage dpo's loss with its reference model built as ``Trainer._preference_losses`` builds it (a frozen copy of
    the policy in the compute dtype, sharded like it; LoRA's reference is the policy with its adapters off); None
    for the LM loss. Under PP the job precomputes the reference's log-probs instead: not traced."""
    if spec.stage != "dpo":
        return None
    from engine.train import dpo

    if mesh["pp"].size() > 1 or spec.precompute_ref_log_probs:
        raise ValueError("stage: the trace runs dpo with its reference model in the step (no PP, no precompute)")
    assert spec.seq_length is not None
    seeded = dpo.SeededInit
    dpo.SeededInit = lambda *_: None  # type: ignore[assignment,misc]  # left unfilled, as the policy is: no values
    try:
        ref = dpo.build_reference(spec, cfg, mesh, model, gbs, spec.seq_length, device.torch_device)
    finally:
        dpo.SeededInit = seeded  # type: ignore[misc]
    chunk = spec.cross_entropy_chunk_size
    return dpo.dpo_loss(dpo.preference_config(spec), ref, chunk, mesh["tp"].size() > 1)


def _one_step(
    spec: TrainSpec,
    cfg: ModelConfig,
    dims: ParallelDims,
    gbs: int,
    device: Device,
    mesh: DeviceMesh,
    batches: list[MicroBatch],
    tracker: StepTracker,
    building: Callable[[], contextlib.AbstractContextManager[None]],
) -> None:
    """Build the rank's model, runner and optimizer, then run two steps: the first creates the optimizer state (Adam
    makes it at its first ``step()``), so the second is a steady-state step, the one every later step repeats; the
    peak is measured over it."""
    assert spec.seq_length is not None
    with building():  # construction (LoRA makes its adapters on the host, then moves them), not the step
        model = build_rank_model(cfg, mesh, spec, gbs, spec.seq_length, device.torch_device, None)
    tracker.track_model(model)
    with building():
        losses_fn = _preference_loss(spec, cfg, mesh, model, gbs, device)
    runner = make_runner(model, mesh, device.torch_device, spec.cross_entropy_chunk_size, losses_fn)
    pp = mesh["pp"]
    router = RouterTracker(model, runner.dp_group, pp.get_group() if pp.size() > 1 else None, dims.cp)
    optimizer = build_optimizer(model, spec)
    scheduler = Scheduler(optimizer, schedule_from_spec(spec))
    scaler = LossScaler(spec)
    params = [p for p in runner.module.parameters() if p.requires_grad]
    for step in range(2):
        if step:
            tracker.restart_peak()
        counts = _global_counts(batches, runner)
        if router:
            router.set_token_weight(scaler.scale / counts[1].clamp(min=1.0))
        denominator = counts[0].clamp(min=1.0)
        if isinstance(runner, PipelineRunner):  # it reads the count on the host (float()): a fake cannot answer
            denominator = cast(torch.Tensor, float(max(1, sum(mb.loss_units for mb in batches))))
        losses = runner.forward_backward(batches, denominator, scaler.scale)
        reduce_over_context(runner.module)
        grad_norm = runner.grad_norm()
        clip_grads(params, spec.clip_grad, grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        runner.reduce(losses)


def _boundary(
    spec: TrainSpec, cfg: ModelConfig, dims: ParallelDims
) -> Callable[[tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of the hidden state one pipeline stage sends the next, for a micro-batch's positions shape."""
    sp = dims.tp if spec.sequence_parallel else 1

    def boundary(positions: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
        rows, width = positions
        return (rows, -(-width // sp), cfg.hidden_size), compute_dtype(spec)

    return boundary


def _tied_shard(spec: TrainSpec, cfg: ModelConfig, dims: ParallelDims) -> tuple[int, ...] | None:
    """The local gradient shape of a tied embedding on its holders (vocabulary over TP, then FSDP's dim-0 shard over
    DP, padded to equal shards); None when LoRA freezes it."""
    if spec.lora_r is not None:
        return None
    rows = cfg.vocab_size // dims.tp
    shard = dims.dp if spec.use_distributed_optimizer else 1
    return (-(-rows // shard), cfg.hidden_size)


def trace_rank(spec: TrainSpec, cfg: ModelConfig, dims: ParallelDims, gbs: int, rank: int) -> RankTrace:
    """Rank ``rank``'s peak over building its model and one training step, on fake tensors of the spec's device."""
    started = time.perf_counter()
    device = Device(spec.resources.device_type)
    backend = f"cpu:fake,{device.type}:fake"  # the fake collectives for host and device tensors alike
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        mesh = build_mesh(device, dims)  # the mesh's rank table is a real host tensor: built before faking
        batches = context_shards(worst_case_batches(spec, cfg, gbs // (spec.micro_batch_size * dims.dp)), dims, mesh)
        watch = StepWatch()
        watch.label_rows = batches[0].num_loss_tokens
        if cfg.moe_layers and cfg.num_experts:
            rows = batches[0].input_ids.numel() * cfg.moe_router_topk
            watch.ep_rows = (dims.ep, rows, cfg.num_experts // dims.ep)
        if (counted := batches[0].counted) is not None:
            watch.counted_row = (counted.shape[-1], int(counted.sum()))
        with (
            fake_pipeline_peers(_boundary(spec, cfg, dims)),
            host_attention_plans(SegmentOracle(batches), watch.paused),
            host_batch_staging(watch.paused),
            sharding_propagation_paused(watch.paused),
            local_tied_shape(_tied_shard(spec, cfg, dims)),
            fake_activations_freed(),
            host_mesh_coordinates(),
            swappable_fake_parameters(),
            FakeTensorMode(allow_non_fake_inputs=True),
            StepTracker(module_hooks=dims.pp == 1) as tracker,
            watch,
        ):
            _one_step(spec, cfg, dims, gbs, device, mesh, batches, tracker, watch.paused)
        snapshots = tracker.get_tracker_snapshot("peak")
        peak = next((v for d, v in snapshots.items() if d.type == device.type), {"Total": 0})
        host = next((v for d, v in snapshots.items() if d.type == "cpu"), {"Total": 0})
    finally:
        end_fake_group(device.torch_device)
    return rank_trace(rank, peak, watch, started, int(host.get("Total", 0)))


def end_fake_group(device: torch.device | None = None) -> None:
    """Destroy the trace's fake process group and forget DTensor's sharding decisions: they are cached by spec, and a
    spec's mesh compares equal across traces (same world rank map, layout and names: stage 1's TP mesh of ranks 2, 3
    equals stage 0's of ranks 0, 1) while its process groups die with this one, so the next rank's trace would be
    handed this mesh (TP under PP failed so; with SP in the backward's reduce-scatters, on the device's thread)."""
    dist.destroy_process_group()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's (thread-local)
    _clear_in_backward_thread(device)
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()


class _ClearShardingCache(torch.autograd.Function):
    """Identity whose backward clears the C++ fast path's sharding cache of the thread running it."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # the context is not used
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        torch._C._clear_DTensor_sharding_propagator_cache()
        return grad


def _clear_in_backward_thread(device: torch.device | None) -> None:
    """The C++ sharding cache is per thread, and the autograd engine runs an accelerator's backward on its own
    thread: the gradients' shardings (SP's reduce-scatters) were cached there on the last trace's meshes. A
    one-element backward on the device clears that thread's cache too (a CPU backward runs on the caller's)."""
    if device is None or device.type == "cpu":
        return
    with FakeTensorMode():
        x = torch.zeros(1, device=device, requires_grad=True)
        _ClearShardingCache.apply(x).sum().backward()


def rank_trace(rank: int, peak: dict[str, int], watch: StepWatch, started: float, host_peak: int = 0) -> RankTrace:
    """One rank's figures from MemTracker's peak snapshot of the device (and the host's peak) and the step's watch."""
    breakdown = {KINDS.get(k, k): v for k, v in peak.items() if k != "Total" and v}
    return RankTrace(
        rank=rank,
        peak_bytes=int(peak.get("Total", 0)),
        breakdown=breakdown,
        host_tensors=sum(watch.host_ops.values()),
        host_ops=watch.host_ops,
        host_syncs=watch.host_syncs,
        collective_bytes_per_step=watch.collectives,
        wall_s=round(time.perf_counter() - started, 2),
        host_peak_bytes=host_peak,
    )
