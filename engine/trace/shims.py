"""What a fake step cannot run as torch wrote it, and what stands in for it (only while a trace runs).

torch.distributed.pipelining's first step votes over the pipeline's ranks whether every stage's shapes are static
(``_PipelineSchedule._warmup_p2p``: a send/recv chain, then ``.item()`` on the result), which a fake tensor cannot
answer, and exchanges each stage's tensor metadata (pickled into host tensors, ``send_object_list``). The stand-in takes each stage's own vote: a job's pipeline ranks run the same code on micro-batches of one
shape, so their votes agree. The attention plan's host reads of the batch's segment ids
(``engine.model.attention.plan_attention``) are answered from the host batch (``SegmentOracle``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining._utils import (
    InferenceMode,
    _StageBackwardMeta,
    _StageForwardMeta,
    extract_tensor_metas,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as C10dBackend
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

    from engine.model.attention import AttentionPlan
    from engine.parallel.pipeline_parallel import StackedBatches, StageBatch
    from engine.train.batches import MicroBatch


def _local_vote(
    self: schedules._PipelineSchedule, stages: list[_PipelineStageBase], has_backward: bool, p2p_done: bool = False
) -> None:
    for stage in stages:
        assert isinstance(stage, PipelineStage)  # the engine's pipeline builds no other kind
        dynamic = InferenceMode.needs_dynamic(stage._user_meta, has_backward)
        stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC


@contextlib.contextmanager
def fake_pipeline_peers(boundary: Callable[[tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]]) -> Iterator[None]:
    """The pipeline's first-step exchanges with the other stages' ranks, answered locally. ``boundary``: the
    (shape, dtype) of the activation a stage receives, from the micro-batch's ``position_ids`` shape: every stage
    boundary of this engine is the hidden state (a sequence shard of it under sequence parallelism)."""
    originals = (
        schedules._PipelineSchedule._warmup_p2p,
        PipelineStage._forward_metadata_inference,
        PipelineStage._recv_meta,
        PipelineStage._send_meta,
    )
    infer = originals[1]
    positions: dict[int, tuple[int, ...]] = {}  # id(stage) -> its micro-batch's position_ids shape

    def forward_inference(
        self: PipelineStage,
        args: tuple[torch.Tensor, ...] | _StageForwardMeta | None,
        kwargs: dict[str, Any] | None = None,  # Any: the stage module's keyword arguments, as torch types them
        has_backward: bool = False,
    ) -> _StageForwardMeta | None:
        positions[id(self)] = tuple((kwargs or {})["position_ids"].shape)
        return infer(self, args, kwargs, has_backward)

    def recv_meta(self: PipelineStage, src_stage: int) -> _StageForwardMeta | _StageBackwardMeta:
        if src_stage > self.stage_index:  # the gradient of this stage's outputs: shaped as the outputs
            outputs = self._stage_meta.outputs
            assert outputs is not None  # the forward metadata came first
            return _StageBackwardMeta(backward_metas=outputs)
        shape, dtype = boundary(positions[id(self)])
        hidden = torch.empty(shape, dtype=dtype, device="meta", requires_grad=has_grad(self))
        metas = extract_tensor_metas((hidden,))
        assert metas is not None  # one tensor in, one meta out
        return _StageForwardMeta(forward_metas=metas)

    schedules._PipelineSchedule._warmup_p2p = _local_vote  # type: ignore[method-assign]
    PipelineStage._forward_metadata_inference = forward_inference  # type: ignore[method-assign]
    PipelineStage._recv_meta = recv_meta  # type: ignore[method-assign]
    # the peers answer locally (``recv_meta``): nothing to send (torch pickles the metadata into a host tensor)
    PipelineStage._send_meta = _no_send  # type: ignore[method-assign]
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = originals[0]  # type: ignore[method-assign]
        PipelineStage._forward_metadata_inference = originals[1]  # type: ignore[method-assign]
        PipelineStage._recv_meta = originals[2]  # type: ignore[method-assign]
        PipelineStage._send_meta = originals[3]  # type: ignore[method-assign]


def _no_send(self: object, meta: object, dst_stage: int) -> None:
    pass


def has_grad(stage: PipelineStage) -> bool:
    return any(p.requires_grad for p in stage.submod.parameters()) or torch.is_grad_enabled()


class SegmentOracle:
    """The real segment ids behind the step's fake ones, by shape: the attention plan reads them on the host (sample
    boundaries, the longest sample), which a fake tensor cannot answer. Every worst-case micro-batch has the same
    layout, so a shape names one host tensor: a micro-batch's own, or the pipeline's padding of it to a wider row
    (``stack_micro_batches``)."""

    def __init__(self, batches: list[MicroBatch]) -> None:
        self.segments = [mb.segment_ids for mb in batches if mb.segment_ids is not None]

    def host(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        for seg in self.segments:
            if tuple(seg.shape) == shape:
                return seg
            if seg.shape[0] == shape[0] and seg.shape[1] <= shape[1]:
                return torch.cat([seg, seg[:, -1:].expand(shape[0], shape[1] - seg.shape[1])], dim=1)
        return None


@contextlib.contextmanager
def host_attention_plans(
    oracle: SegmentOracle, paused: Callable[[], contextlib.AbstractContextManager[None]]
) -> Iterator[None]:
    """``plan_attention`` answered from the oracle's host segment ids (the kernel still chosen by the fake device's
    type), its tensors then moved to the device as the engine's own would be."""
    from engine.model import attention, qwen3

    original = qwen3.plan_attention

    def planned(
        device: torch.device,
        q_len: int,
        past_len: int = 0,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        batch: int = 1,
        runs_only: bool = False,
    ) -> AttentionPlan:
        host = None if segment_ids is None else oracle.host(tuple(segment_ids.shape))
        if segment_ids is None and _npu_plain_causal(device, past_len, attention_mask, runs_only):
            # the NPU path gives plain causal rows one sample each (``plan_attention``): their ids are zeros
            with unset_fake_temporarily():  # a host tensor, not one of the step's fakes
                host = torch.zeros(batch, q_len, dtype=torch.long)
        if host is None:
            return original(device, q_len, past_len, segment_ids, attention_mask, batch, runs_only)
        with paused(), unset_fake_temporarily():
            plan = original(device, q_len, past_len, host, attention_mask, batch, runs_only)
        moved = {
            f.name: getattr(plan, f.name).to(device)
            for f in dataclasses.fields(plan)
            if isinstance(getattr(plan, f.name), torch.Tensor)
        }
        return dataclasses.replace(plan, **moved)

    qwen3.plan_attention = planned
    attention._NPU_CAUSAL_MASK.clear()  # a fake mask cached by an earlier trace belongs to its fake mode
    try:
        yield
    finally:
        qwen3.plan_attention = original
        attention._NPU_CAUSAL_MASK.clear()


def _npu_plain_causal(
    device: torch.device, past_len: int, attention_mask: torch.Tensor | None, runs_only: bool
) -> bool:
    from engine.model.kernels import attention_kernel

    plain = attention_mask is None and not past_len and not runs_only
    return plain and attention_kernel(device.type) == "npu_fusion"


@contextlib.contextmanager
def host_batch_staging(paused: Callable[[], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
    """The pipeline runner pads and stacks the step's micro-batches on the host before moving them to the device
    (``stack_micro_batches``): the data loader's work, not host tensors of the step."""
    from engine.train import step_runner

    original = step_runner.stack_micro_batches

    def staged(batches: Sequence[StageBatch], width: int) -> StackedBatches:
        with paused():
            return original(batches, width)

    step_runner.stack_micro_batches = staged
    try:
        yield
    finally:
        step_runner.stack_micro_batches = original


@contextlib.contextmanager
def sharding_propagation_paused(paused: Callable[[], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
    """DTensor's uncached sharding propagation (under TP, e.g. for ``linear_fc1``'s first call) runs ops on host
    tensors in the step's fake mode to infer shapes: DTensor's bookkeeping, not host tensors of the step."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator.propagate_op_sharding_non_cached

    def propagated(self: ShardingPropagator, op_schema: OpSchema) -> OutputSharding:
        with paused():
            return original(self, op_schema)

    ShardingPropagator.propagate_op_sharding_non_cached = propagated  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator.propagate_op_sharding_non_cached = original  # type: ignore[method-assign]


@contextlib.contextmanager
def local_tied_shape(fallback: tuple[int, ...] | None) -> Iterator[None]:
    """The tied embedding's gradient shape, which the pipeline asks every stage for once (``all_gather_object``: a
    pickled host exchange the fake process group cannot answer): a holder's own local shape, else ``fallback``
    (the holders' shard, None when the embedding is frozen), as the holders would have answered."""
    from engine.parallel import pipeline_parallel as pp

    original = pp._local_embedding_shape

    def answered(pipe: pp.Pipeline, ref: torch.Tensor | None) -> tuple[int, ...] | None:
        if "shape" not in pipe._norm:
            mine = None if ref is None or not ref.requires_grad else tuple(pp._local(ref).shape)
            pipe._norm["shape"] = mine if ref is not None else fallback
        return pipe._norm["shape"]

    pp._local_embedding_shape = answered
    try:
        yield
    finally:
        pp._local_embedding_shape = original


@contextlib.contextmanager
def fake_activations_freed() -> Iterator[None]:
    """``lean_ops.free_until_grad`` frees an activation's storage until backward for plain tensors only (a tensor
    subclass's storage is not its own), and a fake tensor is a subclass: without this stand-in the trace would keep
    every SwiGLU product and freed attention output that the device job frees. For fake tensors it does what the
    engine's function does for plain ones (same conditions, storage resized to 0, rebuilt by a hook on ``out``'s
    gradient); every other tensor goes to the engine's own function."""
    from torch._subclasses.fake_tensor import FakeTensor

    from engine.model import lean_ops, qwen3
    from engine.torch_compat import in_backward

    original = lean_ops.free_until_grad

    def freed(act: torch.Tensor, out: torch.Tensor, values: Callable[[], torch.Tensor]) -> None:
        if type(act) is not FakeTensor:
            original(act, out, values)
            return
        if not (torch.is_grad_enabled() and out.requires_grad and act.is_contiguous()) or in_backward():
            return
        size = act.untyped_storage().nbytes()
        held: list[Any] = [act, values]  # Any: the activation and its rebuild, unpacked together

        def rebuild(grad: torch.Tensor) -> None:
            if held:
                act_, values_ = held
                held.clear()
                act_.untyped_storage().resize_(size)
                with torch.no_grad():
                    act_.data.copy_(values_())

        out.register_hook(rebuild)
        act.untyped_storage().resize_(0)

    lean_ops.free_until_grad = freed
    qwen3.free_until_grad = freed
    try:
        yield
    finally:
        lean_ops.free_until_grad = original
        qwen3.free_until_grad = original


@contextlib.contextmanager
def host_mesh_coordinates() -> Iterator[None]:
    """Device meshes made while the step is faked (FSDP2 joins its DP mesh and the TP mesh under TP:
    ``DeviceMesh._concatenate``; sub-meshes by name; EP's split of DP, ``_unflatten``) build their rank table from the host tables of the job's mesh,
    then find this rank in it (``nonzero``), which a fake tensor cannot answer: they are made outside the fake mode,
    on host tensors, as in a job."""
    concatenate, getitem, unflatten = DeviceMesh._concatenate, DeviceMesh.__getitem__, DeviceMesh._unflatten

    def concatenated(meshes: list[DeviceMesh]) -> DeviceMesh:
        with unset_fake_temporarily():
            return concatenate(meshes)

    def item(self: DeviceMesh, names: str | tuple[str, ...]) -> DeviceMesh:
        with unset_fake_temporarily():
            return getitem(self, names)

    def unflattened(  # EP's dp -> (dp / ep, ep) split
        self: DeviceMesh,
        dim: int | str,
        mesh_sizes: tuple[int, ...],
        mesh_dim_names: tuple[str, ...],
        backend_override: dict[str, str | C10dBackend.Options | tuple[str, C10dBackend.Options]] | None = None,
    ) -> DeviceMesh:
        with unset_fake_temporarily():
            return unflatten(self, dim, mesh_sizes, mesh_dim_names, backend_override)

    DeviceMesh._concatenate = staticmethod(concatenated)  # type: ignore[method-assign, assignment]
    DeviceMesh.__getitem__ = item  # type: ignore[method-assign]
    DeviceMesh._unflatten = unflattened  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign]
        DeviceMesh.__getitem__ = getitem  # type: ignore[method-assign]
        DeviceMesh._unflatten = unflatten  # type: ignore[method-assign]


@contextlib.contextmanager
def swappable_fake_parameters() -> Iterator[None]:
    """``Module._apply`` (``to_empty``) swaps a parameter that is a fake tensor for its new one
    (``torch.utils.swap_tensors``, where a job's plain meta parameter takes ``.data =``), and a swap refuses a tensor
    that something holds a weak reference to: the fake mode's converter memoises by weak reference every fake it
    wraps around a meta result, the old parameter and the new one alike. A plain fake parameter is one FSDP leaves
    alone (LoRA's frozen base on one DP rank, its ``ignored_params``). Both tensors' memo entries are dropped before
    the swap (a cache of meta -> fake wrappers, which nothing reads back for a parameter)."""
    import torch.utils

    original = torch.utils.swap_tensors

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        mode = active_fake_mode()
        if mode is not None:
            memo = mode.fake_tensor_converter.meta_converter.tensor_memo
            for key in [k for k, v in memo.items() if v is t1 or v is t2]:
                del memo[key]
        original(t1, t2)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original
