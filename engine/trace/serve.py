"""A serve job's memory on fake tensors: the serving model and its KV cache built as ``engine.serve.job.run`` builds
them, and one decode step at a full cache.

The model comes from ``engine.load.inference.build_model`` (meta build, TP sharding without SP, materialised in
the serving dtype) with the planner's model config in place of a checkpoint's (no weights are read: the values are
fakes); the cache is ``engine.serve.slots.SlotCache`` of ``max_num_seqs`` slots × ``max_model_len`` positions per
layer; the step is the serving loop's forward (``Batcher._compute``, under ``torch.inference_mode`` as the loop runs
it) at its largest: the step's token budget (``max_num_batched_tokens``) spread over every slot, each slot filled to
the last of its positions (one decode token per slot when the budget is at most ``max_num_seqs``). The planner
plans the same step (``layout_from_spec``: one prefill chunk spread over the rows, the whole cache). Under TP one rank is traced (the
ranks hold equal shards and run the same forward; the followers replay rank 0's steps).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from engine.contract.layout import ParallelDims
from engine.contract.model_config import ModelConfig
from engine.contract.spec import ServeSpec
from engine.load import inference
from engine.load.inference import build_model
from engine.parallel.device import Device
from engine.parallel.mesh import build_mesh
from engine.serve.batcher import Batcher  # imported outside the fake mode: its module makes a host tensor
from engine.serve.slots import SlotCache
from engine.trace.shims import host_mesh_coordinates, sharding_propagation_paused, swappable_fake_parameters
from engine.trace.step import RankTrace, StepTracker, StepWatch, end_fake_group, rank_trace


@contextlib.contextmanager
def config_only_checkpoint(cfg: ModelConfig) -> Iterator[None]:
    """``build_model``'s checkpoint stands in as ``cfg`` alone: its reader gives the config, and filling the
    materialised model reads nothing (a fake holds no values)."""

    class _ConfigOnly:
        config = cfg

    originals = inference.open_source, inference.fill_parts
    inference.open_source = lambda *_a, **_k: _ConfigOnly()  # type: ignore[assignment]
    inference.fill_parts = lambda *_a, **_k: None
    try:
        yield
    finally:
        inference.open_source, inference.fill_parts = originals


def _step_at_full_cache(spec: ServeSpec, cfg: ModelConfig, device: Device, tp_mesh: DeviceMesh | None) -> None:
    model, cfg, _ = build_model(spec, tp_mesh=tp_mesh, device=device.torch_device)
    dtype = next(model.parameters()).dtype
    kv_heads = cfg.num_query_groups // spec.tensor_model_parallel_size
    cache = SlotCache(cfg, spec.max_num_seqs, spec.max_model_len, dtype, device.torch_device, num_kv_heads=kv_heads)
    batcher = Batcher(model, cache, set(), prefill_chunk=spec.max_num_batched_tokens, prefix_caching=False)
    slots = list(range(spec.max_num_seqs))
    per_row = max(1, min(spec.max_num_batched_tokens // len(slots), spec.max_model_len))
    for slot in slots:
        cache.acquire(slot)
        cache.lengths[slot] = spec.max_model_len - per_row
    with torch.inference_mode():
        batcher._compute(slots, [0] * len(slots), [[0] * per_row for _ in slots])


def trace_serve(spec: ServeSpec, cfg: ModelConfig, rank: int = 0) -> RankTrace:
    """Rank ``rank``'s peak over building the serving model and cache and the largest step at a full cache."""
    started = time.perf_counter()
    device = Device(spec.resources.device_type)
    tp = spec.tensor_model_parallel_size
    world = spec.resources.world_size
    dist.init_process_group(f"cpu:fake,{device.type}:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        tp_mesh = build_mesh(device, ParallelDims.from_world(world, tp=tp))["tp"] if tp > 1 else None
        watch = StepWatch()
        with (
            config_only_checkpoint(cfg),
            sharding_propagation_paused(watch.paused),
            host_mesh_coordinates(),
            swappable_fake_parameters(),
            FakeTensorMode(allow_non_fake_inputs=True),
            StepTracker() as tracker,
            watch,
        ):
            _step_at_full_cache(spec, cfg, device, tp_mesh)
        snapshots = tracker.get_tracker_snapshot("peak")
        peak = next((v for d, v in snapshots.items() if d.type == device.type), {"Total": 0})
    finally:
        end_fake_group()
    return rank_trace(rank, peak, watch, started)
