"""torchrun worker for the sharded-build tests: under each requested layout, every rank builds its part the
trainer's way (``build_rank_model``: meta device, PP split -> TP -> AC -> FSDP, ``to_empty``, its own slices filled)
and the way it was built before (the whole model in fp32 on the host, ``init_weights`` / ``load_state_dict`` of every
key, ``apply_lora``, then split and parallelized), and compares every local parameter bit for bit. Rank 0 writes
``{case: {"mismatches": [...], "params": [n per rank], "opened": [mcore rank files each rank opened]}}`` to a JSON
file.

Run: ``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node N tests/integration/sharded_build_worker.py OUT.json
WORK_DIR CASE..`` with CASE = ``name:key=value,...`` (keys in ``parse``; ``src`` is init, hf or mcore, the mcore
checkpoint written with TP ``ctp`` × PP ``cpp``). Ends with os._exit (docs/torch-distributed-on-gloo.md §f.1).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.checkpoint.hf import save_hf
from engine.checkpoint.megatron_write import save_mcore
from engine.checkpoint.sources import SeededInit
from engine.contract.model_config import ModelConfig, preset
from engine.contract.spec import TrainSpec
from engine.load.rank_model import build_rank_model
from engine.load.weights import open_load, rank_view
from engine.model.lora import apply_lora
from engine.model.qwen3 import Qwen3Model
from engine.parallel.device import Device
from engine.parallel.mesh import ParallelDims, build_mesh
from engine.parallel.parallelize import parallelize
from engine.parallel.pipeline_parallel import build_pipeline_model
from gloo_worker_support import run_ranks

SEQ, GLOBAL_BATCH, MICRO_BATCH, VOCAB, SEED = 34, 8, 2, 256, 11


def parse(case: str) -> dict[str, Any]:
    name, _, rest = case.partition(":")
    opts: dict[str, Any] = {
        "name": name,
        "tp": 1,
        "pp": 1,
        "dp": 1,
        "layers": 4,
        "tied": 0,
        "lora": 0,
        "vpp": 0,
        "src": "init",
        "ctp": 1,
        "cpp": 1,
        "ac": "",
        "bf16": 0,
    }
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        opts[key] = value if key in ("src", "ac") else int(value)
    return opts


def make_spec(opts: dict[str, Any], world: int) -> TrainSpec:
    lora = {"lora_r": 4, "lora_alpha": 8.0} if opts["lora"] else {}
    return TrainSpec.model_validate(
        {
            "kind": "train",
            "data_path": ["unused"],
            "train_iters": 1,
            "lr": 1e-3,
            "seq_length": SEQ,
            "seed": SEED,
            "micro_batch_size": MICRO_BATCH,
            "global_batch_size": GLOBAL_BATCH,
            "bf16": bool(opts["bf16"]),
            "tensor_model_parallel_size": opts["tp"],
            "pipeline_model_parallel_size": opts["pp"],
            "sequence_parallel": opts["tp"] > 1,
            "num_layers_per_virtual_pipeline_stage": opts["vpp"] or None,
            "recompute_granularity": opts["ac"] or None,
            "resources": {"nproc_per_node": world},
            **lora,
        }
    )


def model_config(opts: dict[str, Any]) -> ModelConfig:
    return preset("qwen3-tiny-tied" if opts["tied"] else "qwen3-tiny").replace(
        vocab_size=VOCAB, num_layers=opts["layers"]
    )


def write_checkpoint(opts: dict[str, Any], cfg: ModelConfig, work: Path) -> str | None:
    """Rank 0 writes the case's source checkpoint (weights ``init_weights(7)``); every rank gets its path."""
    if opts["src"] == "init":
        return None
    path = work / f"{opts['name']}-{opts['src']}"
    if dist.get_rank() == 0:
        full = Qwen3Model(cfg)
        full.init_weights(7)
        state = full.state_dict()
        if opts["src"] == "hf":
            save_hf(state, cfg, path)
        else:
            save_mcore(state, cfg, path, tp=opts["ctp"], pp=opts["cpp"])
    dist.barrier()
    return str(path)


def old_build(opts: dict[str, Any], cfg: ModelConfig, spec: TrainSpec, mesh: Any, path: str | None) -> Any:
    """The build this replaces: the whole fp32 model on every rank, every key loaded, then split and sharded."""
    model = Qwen3Model(cfg)
    if path is None:
        model.init_weights(spec.seed)
    else:
        source = open_load(path).source
        model.load_state_dict({k: source.get_native(k).float() for k in model.state_dict()}, strict=True)
    if opts["lora"]:
        apply_lora(model, spec.lora_r, spec.lora_alpha, spec.lora_dropout, spec.lora_target_modules, seed=spec.seed)
    if opts["pp"] > 1:
        return build_pipeline_model(model, mesh, spec, GLOBAL_BATCH, SEQ, lambda part: parallelize(part, mesh, spec))
    return parallelize(model, mesh, spec)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def compare(opts: dict[str, Any], work: Path) -> dict[str, Any]:
    world = dist.get_world_size()
    spec = make_spec(opts, world)
    cfg = model_config(opts)
    dims = ParallelDims(dp=opts["dp"], pp=opts["pp"], tp=opts["tp"])
    mesh = build_mesh(Device("cpu"), dims)
    path = write_checkpoint(opts, cfg, work)
    base = SeededInit(cfg, spec.seed) if path is None else open_load(path, rank_view(spec, dims)).source
    new = build_rank_model(cfg, mesh, spec, GLOBAL_BATCH, SEQ, torch.device("cpu"), base)
    opened = [f"{f.parent.name}/{f.name}" for f in base.opened_files()] if opts["src"] == "mcore" else []
    old = old_build(opts, cfg, spec, mesh, path)
    new_params, old_params = dict(new.named_parameters()), dict(old.named_parameters())
    bad = sorted(set(new_params) ^ set(old_params))
    for name, p in new_params.items():
        q = old_params.get(name)
        if q is None:
            continue
        a, b = local(p), local(q)
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b) or p.requires_grad != q.requires_grad:
            bad.append(name)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (bad, len(new_params), opened))
    return {
        "mismatches": sorted({n for names, _, _ in gathered for n in names}),
        "params": [n for _, n, _ in gathered],
        "opened": [files for _, _, files in gathered],
    }


def run_cases(work: Path, cases: list[str]) -> dict[str, Any]:
    results = {}
    for case in cases:
        opts = parse(case)
        results[opts["name"]] = compare(opts, work)
    return results


if __name__ == "__main__":
    run_ranks(lambda: run_cases(Path(sys.argv[2]), sys.argv[3:]))
