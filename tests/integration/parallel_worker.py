"""torchrun worker for the parallel-layout tests. Every rank trains the tiny model single-process (the reference,
on a one-rank group), then under each requested layout, both through the trainer's own ``train_step``,
``parallelize`` / ``build_pipeline_model`` and ``engine.checkpoint.dcp``; rank 0 writes the per-step losses and
grad norms of both to a JSON file.

Run: ``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node N tests/integration/parallel_worker.py OUT.json CASE..``
with CASE = ``name:key=value,...`` (keys in ``parse``; ``moe=1``: a Qwen3-MoE model, its router figures recorded too; ``ep``: expert parallel
size, carved out of dp). Ends with os._exit (the gloo/DeviceMesh exit-crash trap,
docs/torch-distributed-on-gloo.md §f.1).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.checkpoint import dcp
from engine.contract.model_config import preset
from engine.contract.spec import TrainSpec
from engine.model.lora import apply_lora
from engine.model.qwen3 import Qwen3Model
from engine.parallel.device import Device
from engine.parallel.mesh import ParallelDims, build_mesh
from engine.parallel.parallelize import parallelize
from engine.parallel.pipeline_parallel import build_pipeline_model
from engine.train.batches import MicroBatch, Sample, pad
from engine.train.loop import TrainState, train_step
from engine.train.optim import LossScaler, build_optimizer
from engine.train.router_stats import RouterTracker, router_summary
from engine.train.schedule import Scheduler, schedule_from_spec
from engine.train.step_runner import ModuleRunner, StepRunner, lm_loss, make_runner
from gloo_worker_support import run_ranks

SEQ, GLOBAL_BATCH, MICRO_BATCH, STEPS, VOCAB = 34, 8, 2, 5, 256  # 33 tokens after the shift: uneven TP2 sequence shards


def parse(case: str) -> dict[str, Any]:
    name, _, rest = case.partition(":")
    opts: dict[str, Any] = {
        "name": name,
        "tp": 1,
        "pp": 1,
        "dp": 1,
        "layers": 2,
        "sp": 1,
        "tied": 0,
        "lora": 0,
        "vpp": 0,
        "list": "",
        "save_at": 0,
        "load": "",
        "ckpt": "",
        "start": 0,
        "steps": STEPS,
        "ac": "",
        "scale": 1,
        "moe": 0,
        "ep": 1,
    }
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        opts[key] = value if key in ("list", "load", "ckpt", "ac") else int(value)
    return opts


def make_spec(opts: dict[str, Any], world: int) -> TrainSpec:
    return TrainSpec.model_validate(
        {
            "kind": "train",
            "data_path": ["unused"],
            "train_iters": 100,
            "lr": 1e-3,
            "lr_decay_style": "constant",
            "clip_grad": 0.5,
            "weight_decay": 0.01,
            "seq_length": SEQ,
            "micro_batch_size": MICRO_BATCH,
            "global_batch_size": GLOBAL_BATCH,
            "tensor_model_parallel_size": opts["tp"],
            "pipeline_model_parallel_size": opts["pp"],
            "expert_model_parallel_size": opts["ep"],
            "sequence_parallel": bool(opts["sp"]),
            "num_layer_list": [int(x) for x in opts["list"].split("-")] if opts["list"] else None,
            "num_layers_per_virtual_pipeline_stage": opts["vpp"] or None,
            "recompute_granularity": opts["ac"] or None,
            "padding_free": False,
            "resources": {"nproc_per_node": world},
        }
    )


def samples(step: int) -> list[Sample]:
    """The global batch of ``step``: different lengths and a different number of prompt (-100) tokens per sample."""
    rng = np.random.default_rng(1000 + step)
    out = []
    for i in range(GLOBAL_BATCH):
        n = SEQ - (3 * i + step) % 9
        ids = rng.integers(1, VOCAB, n)
        labels = ids.copy()
        labels[: (5 * i + step) % 11] = -100
        out.append(Sample(ids, labels))
    return out


def micro_batches(step: int, dp: int, dp_rank: int) -> list[MicroBatch]:
    """This DP rank's micro-batches in Megatron's order (micro-batch m takes samples m·mbs·DP + r·mbs ...)."""
    batch = samples(step)
    firsts = range(dp_rank * MICRO_BATCH, GLOBAL_BATCH, MICRO_BATCH * dp)
    return [pad(batch[f : f + MICRO_BATCH], SEQ, to_longest=False) for f in firsts]


def build_model(opts: dict[str, Any]) -> Qwen3Model:
    base = preset("qwen3-tiny-tied" if opts["tied"] else "qwen3-tiny")
    k = opts["scale"]  # widen hidden, FFN and head size k times (benchmarks)
    cfg = base.replace(
        vocab_size=VOCAB,
        num_layers=opts["layers"],
        hidden_size=base.hidden_size * k,
        ffn_hidden_size=base.ffn_hidden_size * k,
        kv_channels=base.kv_channels * k,
    )
    if opts["moe"]:  # 4 experts top-2 with the aux loss; with 4 layers layer 2 is dense (a PP2 stage mixes both)
        freq = (1, 1, 0, 1) if opts["layers"] == 4 else 1
        cfg = cfg.replace(
            num_experts=4,
            moe_router_topk=2,
            moe_ffn_hidden_size=32,
            moe_layer_freq=freq,
            norm_topk_prob=True,
            moe_aux_loss_coeff=0.01,
        )
    model = Qwen3Model(cfg)
    model.init_weights(seed=0)
    if opts["lora"]:
        apply_lora(model, r=4, alpha=8.0, seed=1)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():  # non-zero B so every adapter gets a gradient from step 0
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def train(
    runner: StepRunner,
    spec: TrainSpec,
    opts: dict[str, Any],
    dp: int,
    dp_rank: int,
    router: RouterTracker | None = None,
    router_rows: list[dict[str, float]] | None = None,
) -> list[tuple[float, float, float]]:
    """``router``: the MoE layers' tracker; each step's router metrics are appended to ``router_rows``."""
    model = runner.module
    optimizer = build_optimizer(model, spec)
    scheduler, scaler, state = Scheduler(optimizer, schedule_from_spec(spec)), LossScaler(spec), TrainState()
    if opts["load"]:
        meta = dcp.load(opts["load"], model, optimizer)
        state.iteration = meta["iteration"]
    out = []
    for step in range(opts["start"], opts["start"] + opts["steps"]):
        start = time.perf_counter()
        rec = train_step(
            runner,
            optimizer,
            scheduler,
            scaler,
            micro_batches(step, dp, dp_rank),
            state,
            global_batch_size=GLOBAL_BATCH,
            clip_grad=spec.clip_grad,
            router=router,
        )
        if router and router_rows is not None and rec.router is not None:
            router_rows.append(router_summary(router.layers, rec.router.tolist()))
        # (loss, grad norm, step seconds); the float() calls are the step's host syncs, so the time is complete
        out.append((float(rec.loss_sum / rec.counts[0]), float(rec.grad_norm), time.perf_counter() - start))
        if opts["save_at"] and step + 1 == opts["save_at"]:
            dcp.save(opts["ckpt"], step + 1, model, optimizer, {})
    return out


def expert_layout(module: torch.nn.Module) -> dict[str, Any]:
    """Mesh dims, placements and local shape of every stacked expert weight this rank holds (base and LoRA)."""
    return {
        name: [list(p.device_mesh.mesh_dim_names or ()), [str(x) for x in p.placements], list(p.to_local().shape)]
        for name, p in module.named_parameters()
        if ".mlp.experts." in name and isinstance(p, DTensor)
    }


def parallel(
    opts: dict[str, Any], router_rows: list[dict[str, float]], layout: dict[str, Any]
) -> list[tuple[float, float, float]]:
    spec = make_spec(opts, dist.get_world_size())
    mesh = build_mesh(Device("cpu"), ParallelDims(dp=opts["dp"], pp=opts["pp"], tp=opts["tp"]))
    model = build_model(opts)
    if opts["pp"] > 1:
        model = build_pipeline_model(model, mesh, spec, GLOBAL_BATCH, SEQ, lambda part: parallelize(part, mesh, spec))
    else:
        model = parallelize(model, mesh, spec)
    runner = make_runner(model, mesh, torch.device("cpu"), chunk_size=64)
    layout.update(expert_layout(runner.module))
    pp_group = mesh["pp"].get_group() if opts["pp"] > 1 else None
    router = RouterTracker(model, runner.dp_group, pp_group) if opts["moe"] else None
    return train(runner, spec, opts, opts["dp"], mesh["dp"].get_local_rank(), router, router_rows)


def reference(
    opts: dict[str, Any], own_group: Any, router_rows: list[dict[str, float]]
) -> list[tuple[float, float, float]]:
    spec = make_spec({**opts, "tp": 1, "pp": 1, "ep": 1, "list": "", "vpp": 0}, 1)
    runner = ModuleRunner(build_model(opts), torch.device("cpu"), own_group, lm_loss(False, chunk_size=64))
    router = RouterTracker(runner.module, own_group) if opts["moe"] else None
    return train(runner, spec, {**opts, "load": "", "save_at": 0}, 1, 0, router, router_rows)


# Options the one-process reference does not depend on: the layout (``reference`` resets tp/pp/ep/list/vpp, dp only
# shards the batch, sp and ac only act under ``parallelize``) and the checkpoint ones (it never loads or saves).
LAYOUT_ONLY = frozenset({"name", "tp", "pp", "dp", "ep", "sp", "vpp", "list", "ac", "save_at", "ckpt"})


def run_cases(cases: list[str]) -> dict[str, Any]:
    # One single-rank group per rank (created collectively, in the same order everywhere) for the reference.
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    results = {}
    # Cases of one model (say TP2, TP2 without SP, TP2 with recompute) share one reference run: the rank-0 time the
    # other ranks wait through, once per model instead of once per layout.
    references: dict[tuple, tuple[list, list]] = {}
    for case in cases:
        opts = parse(case)
        par_router: list[dict[str, float]] = []
        layout: dict[str, Any] = {}
        entry: dict[str, Any] = {"parallel": parallel(opts, par_router, layout), "parallel_router": par_router}
        entry["expert_layout"] = layout  # rank 0's
        if not opts["load"] and dist.get_rank() == 0:
            key = tuple(sorted((k, v) for k, v in opts.items() if k not in LAYOUT_ONLY))
            if key not in references:
                ref_router: list[dict[str, float]] = []
                references[key] = (reference(opts, own, ref_router), ref_router)
            entry["reference"], entry["reference_router"] = references[key]
        results[opts["name"]] = entry
    return results


if __name__ == "__main__":
    run_ranks(lambda: run_cases(sys.argv[2:]))
