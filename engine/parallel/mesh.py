"""The dp × pp × tp DeviceMesh every parallelism step is applied over.

Row-major over (dp, pp, tp): tp varies fastest, so neighbouring ranks share a TP group and TP stays inside a node.
Dimension names ``dp``, ``pp``, ``tp`` are what ``parallelize`` and the trainer look up.
A single process still gets a (1, 1, 1) mesh over a one-rank group, so FSDP2, DCP and collectives run the same code
path at any world size.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.contract.layout import ParallelDims
from engine.parallel.device import Device

__all__ = ["ParallelDims", "build_mesh", "ensure_process_group"]


def ensure_process_group(device: Device) -> None:
    """Start a one-rank group when torchrun did not start one (plain ``python -m engine train``)."""
    if not dist.is_initialized():
        dist.init_process_group(backend=device.backend, store=dist.HashStore(), rank=0, world_size=1)


def build_mesh(device: Device, dims: ParallelDims) -> DeviceMesh:
    """The ("dp", "pp", "tp") mesh over every rank of the default group."""
    world = dist.get_world_size()
    if dims.world_size != world:
        raise ValueError(f"parallel dims {dims} need {dims.world_size} ranks, the job has {world}")
    return init_device_mesh(device.type, (dims.dp, dims.pp, dims.tp), mesh_dim_names=("dp", "pp", "tp"))
