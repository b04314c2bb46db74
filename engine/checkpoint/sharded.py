"""Fill a meta-built, parallelized model (or pipeline parts) from weight sources, each rank reading its own slice.

The model was built on the ``meta`` device, split into this rank's pipeline stages, sharded by TP and FSDP, then
``to_empty``'d on the device: every parameter is this rank's local piece. For each one the native key (the name,
``checkpoint_wrapper`` prefixes aside) and the TP rank pick the piece a source must read
(``WeightSource.get_native_shard``: the rows of the rank's TP shard, straight from the file), and FSDP's dim-0
chunk of that piece is what the rank keeps. So a rank reads its TP shard of its stage's tensors, one tensor at a
time, and holds nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from engine.checkpoint.layout import shard, split_rule
from engine.checkpoint.reader import read_segment_into
from engine.checkpoint.sources import ByteRanges, WeightSource, expert_range
from engine.torch_compat import StridedShard, compute_local_shape_and_global_offset

_WRAPPED = "_checkpoint_wrapped_module."


def native_name(name: str) -> str:
    """A parameter's native key: activation-checkpoint wrappers and ``torch.compile`` prefixes removed."""
    return name.replace(_WRAPPED, "").replace("_orig_mod.", "")


def _dp_rows(param: torch.Tensor, rows: int) -> tuple[int, int]:
    """The rows of the TP-local tensor this rank keeps under FSDP (``torch.chunk`` on dim 0 over the dp mesh, or the
    flattened dp_cp mesh under context parallelism)."""
    names = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else None
    fsdp = next((n for n in ("dp", "dp_cp") if names is not None and n in names), None)  # dp_cp: DP × CP
    if not isinstance(param, DTensor) or names is None or fsdp is None:
        return 0, rows
    dim = names.index(fsdp)
    placement = param.placements[dim]
    if not (placement.is_shard() or isinstance(placement, StridedShard)):  # FSDP over a TP dim-0 shard: strided
        return 0, rows
    size, rank = param.device_mesh.size(dim), param.device_mesh.get_local_rank(dim)
    step = -(-rows // size)
    start = min(rank * step, rows)
    return start, min(start + step, rows)


def _tp(param: torch.Tensor) -> tuple[int, int]:
    names = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else None
    if not isinstance(param, DTensor) or names is None or "tp" not in names:
        return 1, 0
    dim = names.index("tp")
    return param.device_mesh.size(dim), param.device_mesh.get_local_rank(dim)


def _expert_rows(param: torch.Tensor) -> tuple[int, int] | None:
    """Expert parallelism: the dim-0 rows (experts) of the whole tensor this rank holds — its EP rank's experts, cut
    again by FSDP over ``edp`` (torch's own placement rule, strided shards included); None for other parameters."""
    names = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else None
    if not isinstance(param, DTensor) or names is None or "ep" not in names:
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0], offset[0] + shape[0]


@torch.no_grad()
def fill_parameter(param: torch.Tensor, key: str, source: WeightSource) -> None:
    """Copy this rank's piece of native ``key`` from ``source`` into ``param`` (cast to its dtype)."""
    experts = _expert_rows(param)
    if experts is not None:  # read only this rank's experts
        local = cast(DTensor, param).to_local()
        tp, tp_rank = _tp(param)  # EP × TP: these experts' rows, then their TP slice (per expert)
        piece = (
            shard(expert_range(source, key, *experts), split_rule(key), tp, tp_rank)
            if experts[1] > experts[0]
            else local
        )
        if tuple(piece.shape) != tuple(local.shape):
            raise ValueError(f"{key}: experts {experts} have shape {tuple(piece.shape)}, the local part {local.shape}")
        local.copy_(piece)
        return
    tp, tp_rank = _tp(param)
    local = param.to_local() if isinstance(param, DTensor) else param
    if _read_in_place(local, key, source, tp, tp_rank):
        return
    piece = source.get_native_shard(key, tp, tp_rank)
    start, stop = _dp_rows(param, piece.shape[0] if piece.dim() else 1)
    piece = piece[start:stop]
    if tuple(piece.shape) != tuple(local.shape):
        raise ValueError(
            f"{key}: the source gives a piece of shape {tuple(piece.shape)} for a local parameter of "
            f"shape {tuple(local.shape)} (TP rank {tp_rank} of {tp}, rows {start}:{stop}, "
            f"placements {getattr(param, 'placements', None)})"
        )
    local.copy_(piece)


def _read_in_place(local: torch.Tensor, key: str, source: WeightSource, tp: int, tp_rank: int) -> bool:
    """Read ``key``'s piece straight into ``local`` when the source names it as file byte ranges in local's dtype
    that make up all of it (no DP cut): no temporary the size of the tensor next to the parameter (0.75 GiB for a
    4B model's embedding, the start-up peak otherwise). False when it cannot, and nothing is read."""
    if not isinstance(source, ByteRanges) or not local.is_contiguous():
        return False
    pieces = source.shard_segments(key, tp, tp_rank, local.dtype)
    nbytes = local.numel() * local.element_size()
    if pieces is None or not all(isinstance(p, tuple) for p in pieces) or sum(p[2] for p in pieces) != nbytes:
        return False
    flat = local.view(-1).view(torch.uint8)
    at = 0
    for fd, offset, size in pieces:
        read_segment_into(fd, flat[at : at + size], offset, key)
        at += size
    return True


def fill_parts(parts: Iterable[nn.Module], base: WeightSource | None, lora: WeightSource | None = None) -> None:
    """Fill every parameter of ``parts`` (in order): adapters from ``lora``, the rest from ``base``; a None source
    leaves its parameters as they are (a checkpoint restore writes them next)."""
    for part in parts:
        for name, param in part.named_parameters():
            key = native_name(name)
            source = lora if (".lora_A." in key or ".lora_B." in key) else base
            if source is not None:
                fill_parameter(param, key, source)
