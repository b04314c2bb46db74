"""Admission of a job against the Slurm pool it names (``resources.pool``): 422s naming the field to change."""

from __future__ import annotations

from core.errors import ApiError
from core.settings import Settings, SlurmPool
from engine.contract.plan import DoesNotFit, check_registered_memory
from engine.contract.plan.planner import DEVICE_MEMORY_KEY
from engine.contract.spec import JobBase, Resources

GIB = 1 << 30


def pool_of(settings: Settings, res: Resources) -> SlurmPool:
    """The pool ``res`` names; 422 ``resources.pool`` when the service has no such pool."""
    assert res.pool is not None
    pool = settings.slurm_pools.get(res.pool)
    if pool is None:
        known = ", ".join(sorted(settings.slurm_pools)) or "none are configured"
        raise ApiError(
            422, "unschedulable", f"resources.pool: no Slurm pool {res.pool!r} (pools: {known})", "resources.pool"
        )
    return pool


def check_pool_fits(settings: Settings, res: Resources) -> SlurmPool:
    """Refuse (422) a shape the pool can never run: device type, devices per node, nodes."""
    pool = pool_of(settings, res)
    name = res.pool
    if res.device_type != pool.device_type:
        raise ApiError(
            422,
            "unschedulable",
            f"resources.pool: pool {name!r} has {pool.device_type} devices, the job asks for {res.device_type}",
            "resources.pool",
        )
    if res.nproc_per_node > pool.devices_per_node:
        raise ApiError(
            422,
            "unschedulable",
            f"resources.pool: {res.nproc_per_node} devices per node requested, pool {name!r} nodes have "
            f"{pool.devices_per_node}",
            "resources.pool",
        )
    if res.nnodes > pool.max_nodes:
        raise ApiError(
            422,
            "unschedulable",
            f"resources.pool: {res.nnodes} nodes requested, pool {name!r} allows at most {pool.max_nodes}",
            "resources.pool",
        )
    return pool


def check_pool_memory(settings: Settings, spec: JobBase) -> None:
    """The planner's peak per rank against the pool's device memory (422 ``does_not_fit`` naming the field)."""
    pool = pool_of(settings, spec.resources)
    infos = [{DEVICE_MEMORY_KEY: int(pool.device_memory_gib * GIB)}] if pool.device_memory_gib else []
    try:
        check_registered_memory(spec, infos)
    except DoesNotFit as err:
        raise ApiError(422, "does_not_fit", f"{err} (pool {spec.resources.pool!r})", err.field) from err
