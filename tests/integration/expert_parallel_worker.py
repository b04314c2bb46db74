"""torchrun worker for the expert-parallel layout test: every rank builds the tiny MoE model the trainer's way
(``build_rank_model`` on meta, EP ``sys.argv[2]`` carved out of DP = world, seeded init, selective recompute) and
checks, against the whole model built on the host:

- the stacked experts are ``Shard(0)`` DTensors over ``ep`` (and FSDP over ``edp``), holding only this rank's rows,
  equal to the full model's; every other weight is FSDP-sharded over all of ``dp``;
- with token dropping on (capacity factor 1), a forward and backward over different tokens on every rank give the
  full model's logits on those tokens and, summed over ranks, its expert-weight gradients.

Rank 0 writes ``{"errors": [...], "dropped": n, "local_rows": [...]}`` to ``sys.argv[1]``. Ends with os._exit
(docs/torch-distributed-on-gloo.md §f.1).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from engine.checkpoint.sharded import native_name
from engine.checkpoint.sources import SeededInit
from engine.contract.model_config import preset
from engine.contract.spec import TrainSpec
from engine.load.rank_model import build_rank_model
from engine.model.moe import router_metrics
from engine.model.qwen3 import Qwen3Model
from engine.parallel.device import Device
from engine.parallel.mesh import ParallelDims, build_mesh
from engine.torch_compat import compute_local_shape_and_global_offset
from gloo_worker_support import run_ranks

SEQ, SEED, VOCAB = 24, 5, 256


def _local_rows(param: DTensor) -> tuple[int, int]:
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0], offset[0] + shape[0]


def check(ep: int) -> tuple[list[str], int, list[int]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = preset("qwen3-moe-tiny").replace(vocab_size=VOCAB, moe_expert_capacity_factor=1.0)
    spec = TrainSpec.model_validate(
        {
            "kind": "train",
            "data_path": ["unused"],
            "train_iters": 1,
            "lr": 1e-3,
            "seq_length": SEQ,
            "expert_model_parallel_size": ep,
            "recompute_granularity": "selective",  # the dispatch runs again in the backward's recompute
            "resources": {"nproc_per_node": world},
        }
    )
    mesh = build_mesh(Device("cpu"), ParallelDims(dp=world))
    model = build_rank_model(cfg, mesh, spec, world, SEQ, torch.device("cpu"), SeededInit(cfg, SEED))
    full = Qwen3Model(cfg)
    full.init_weights(SEED)
    full_params = dict(full.named_parameters())
    errors, rows = [], []
    for name, param in model.named_parameters():
        key = native_name(name)
        assert isinstance(param, DTensor)
        names = param.device_mesh.mesh_dim_names
        if ".mlp.experts." in key:
            if names != ("edp", "ep") or param.placements[1] != Shard(0):
                errors.append(f"{key}: mesh {names}, placements {param.placements}")
            start, stop = _local_rows(param)
            rows.append(stop - start)
            if not torch.equal(param.to_local(), full_params[key].detach()[start:stop]):
                errors.append(f"{key}: rows {start}:{stop} differ from the full model's")
        elif names != ("dp",):
            errors.append(f"{key}: mesh {names}, expected dp")

    # different tokens per rank; the full model sees the same ones
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(100 + rank))
    model.train()
    full.train()
    logits, ref = model(ids), full(ids)
    if not torch.allclose(logits, ref, rtol=1e-5, atol=1e-5):
        errors.append(f"logits differ by {float((logits - ref).abs().max())}")
    logits.square().mean().backward()
    ref.square().mean().backward()
    dropped = sum(int(m.dropped.sum()) for m in [router_metrics(model)] if m is not None)
    for name, param in model.named_parameters():
        key = native_name(name)
        if ".mlp.experts." not in key:
            continue
        want = full_params[key].grad.clone()
        dist.all_reduce(want)  # FSDP sums the ranks' gradients
        start, stop = _local_rows(param)
        got = param.grad.to_local()
        if not torch.allclose(got, want[start:stop], rtol=1e-4, atol=1e-6):
            errors.append(f"{key}: gradient differs by {float((got - want[start:stop]).abs().max())}")
    return errors, dropped, rows


def gathered_check(ep: int) -> dict:
    errors, dropped, rows = check(ep)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (errors, dropped, rows))
    return {
        "errors": [e for part in gathered for e in part[0]],
        "dropped": sum(p[1] for p in gathered),
        "local_rows": [r for p in gathered for r in p[2]],
    }


if __name__ == "__main__":
    run_ranks(lambda: gathered_check(int(sys.argv[2])))
