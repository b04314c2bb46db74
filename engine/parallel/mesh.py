"""The dp × (cp ×) pp × tp DeviceMesh every parallelism step is applied over (hybrid context parallelism splits cp
into cp_ring × cp_ulysses and flattens them back into cp).

Row-major over (dp, cp, pp, tp): tp varies fastest, so neighbouring ranks share a TP group and TP stays inside a node.
Dimension names ``dp``, ``pp``, ``tp`` (and ``cp`` with context parallelism, plus ``dp_cp``: the DP × CP ranks, which
all hold different tokens of a step) are what ``parallelize`` and the trainer look up.
A single process still gets a (1, 1, 1) mesh over a one-rank group, so FSDP2, DCP and collectives run the same code
path at any world size.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.contract.layout import ParallelDims
from engine.parallel.device import Device

__all__ = ["ParallelDims", "batch_mesh", "build_mesh", "context_mesh", "ensure_process_group", "mesh_dims"]


def ensure_process_group(device: Device) -> None:
    """Start a one-rank group when torchrun did not start one (plain ``python -m engine train``)."""
    if not dist.is_initialized():
        dist.init_process_group(backend=device.backend, store=dist.HashStore(), rank=0, world_size=1)


def build_mesh(device: Device, dims: ParallelDims) -> DeviceMesh:
    """The ("dp", "pp", "tp") mesh over every rank of the default group; ("dp", "cp", "pp", "tp") with a flattened
    "dp_cp" under context parallelism."""
    world = dist.get_world_size()
    if dims.world_size != world:
        raise ValueError(f"parallel dims {dims} need {dims.world_size} ranks, the job has {world}")
    if dims.cp == 1:
        return init_device_mesh(device.type, (dims.dp, dims.pp, dims.tp), mesh_dim_names=("dp", "pp", "tp"))
    if dims.cp_algo != "hybrid_cp_algo":
        shape, names = (dims.dp, dims.cp, dims.pp, dims.tp), ("dp", "cp", "pp", "tp")
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
        mesh["dp", "cp"]._flatten("dp_cp")  # torchtitan's name and way for the gradient-reduction mesh
        return mesh
    # hybrid: CP = ring × Ulysses, the Ulysses ranks of a ring member neighbours (the all-to-all is the busier link)
    hybrid = (dims.dp, dims.ring_degree, dims.ulysses_degree, dims.pp, dims.tp)
    mesh = init_device_mesh(device.type, hybrid, mesh_dim_names=("dp", "cp_ring", "cp_ulysses", "pp", "tp"))
    mesh["cp_ring", "cp_ulysses"]._flatten("cp")
    mesh["dp", "cp_ring", "cp_ulysses"]._flatten("dp_cp")
    return mesh


def context_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The ranks one sequence is split over, or None without context parallelism."""
    names = mesh.mesh_dim_names or ()
    return mesh["cp"] if "cp" in names and mesh["cp"].size() > 1 else None


def batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that hold different tokens of a step (DP, times CP): gradients, loss units and token counts are
    summed over them, and FSDP shards over them."""
    return mesh["dp_cp"] if context_mesh(mesh) is not None else mesh["dp"]


def mesh_dims(mesh: DeviceMesh) -> ParallelDims:
    """The DP, CP, PP and TP sizes ``mesh`` was built with (``build_mesh`` read back), for ``ParallelDims.coords``
    where only the mesh is at hand; EP is no mesh dimension (it is carved out of DP), so it reads 1 here."""
    cp = context_mesh(mesh)
    return ParallelDims(
        dp=mesh["dp"].size(), pp=mesh["pp"].size(), tp=mesh["tp"].size(), cp=1 if cp is None else cp.size()
    )
