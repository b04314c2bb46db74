"""torchrun worker for the parallel-layout tests: every rank trains the same tiny model single-process as the
reference, then under the requested layouts, and rank 0 writes losses and grad norms of both to a JSON file.

Run: ``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node N tests/integration/parallel_worker.py OUT.json CASE..``
with CASE = name:key=value,... (see ``CASES`` in test_parallel_layouts.py). Ends with os._exit (the gloo/DeviceMesh
exit-crash trap, torch-distributed-on-gloo.md §f.1).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from engine.model.config import preset
from engine.model.lora import apply_lora
from engine.model.loss import chunked_cross_entropy
from engine.model.qwen3 import Qwen3Model
from engine.parallel.data_parallel import apply_fsdp
from engine.parallel.device import Device
from engine.parallel.mesh import ParallelDims, build_mesh
from engine.parallel.pipeline_parallel import build_pipeline, dcp_state_view, norm_parameters, pipeline_grad_norm
from engine.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
from engine.train.optim import clip_grads, total_grad_norm

SEQ, GLOBAL_BATCH, MICRO_BATCH, STEPS, LR, CLIP = 32, 8, 2, 5, 1e-3, 0.5


def parse(case: str) -> dict[str, Any]:
    name, _, rest = case.partition(":")
    opts: dict[str, Any] = {"name": name, "tp": 1, "pp": 1, "dp": 1, "layers": 2, "sp": 1, "tied": 0, "lora": 0,
                            "vpp": 0, "list": "", "save_at": 0, "load": "", "steps": STEPS}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        opts[key] = value if key in ("list", "load", "ckpt") else int(value)
    return opts


def config(opts: dict[str, Any]):
    base = preset("qwen3-tiny-tied" if opts["tied"] else "qwen3-tiny")
    return base.replace(vocab_size=256, num_layers=opts["layers"])


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(GLOBAL_BATCH, SEQ) inputs and labels; a different number of masked prompt tokens per sample."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=g)
    for i in range(GLOBAL_BATCH):
        labels[i, : (3 * i + step) % 11] = -100
    return ids, labels


def build_model(opts: dict[str, Any]) -> Qwen3Model:
    torch.manual_seed(0)
    model = Qwen3Model(config(opts))
    model.init_weights(seed=0)
    if opts["lora"]:
        apply_lora(model, r=4, alpha=8.0, seed=1)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():  # non-zero B so every adapter gets a gradient from step 0
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def reference(opts: dict[str, Any], start_sd: dict | None = None) -> list[tuple[float, float]]:
    model = build_model(opts)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    out = []
    for step in range(opts["steps"]):
        ids, labels = batches(step)
        hidden = model(ids, return_hidden=True)
        loss_sum, n = chunked_cross_entropy(hidden, model.output_weight(), labels)
        (loss_sum / n).backward()
        norm = total_grad_norm(params)
        clip_grads(params, CLIP, norm)
        opt.step()
        opt.zero_grad()
        out.append((float(loss_sum / n), float(norm)))
    return out


def parallel(opts: dict[str, Any]) -> list[tuple[float, float]]:
    dims = ParallelDims(dp=opts["dp"], pp=opts["pp"], tp=opts["tp"])
    mesh = build_mesh(Device("cpu"), dims)
    tp_mesh, dp_mesh, pp_mesh = mesh["tp"], mesh["dp"], mesh["pp"]
    model = build_model(opts)
    sp = bool(opts["sp"])

    def parallelize_part(part: torch.nn.Module) -> torch.nn.Module:
        if tp_mesh.size() > 1:
            apply_tensor_parallel(part, tp_mesh, sequence_parallel=sp)
        if dp_mesh.size() > 1:
            apply_fsdp(part, dp_mesh, None, reshard_after_forward=pp_mesh.size() == 1)
        return part

    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    n_micro = GLOBAL_BATCH // (MICRO_BATCH * dp)
    pipe = None
    if pp_mesh.size() > 1:
        layer_list = [int(x) for x in opts["list"].split("-")] if opts["list"] else None
        pipe = build_pipeline(
            model, pp_mesh, n_micro, num_layer_list=layer_list, layers_per_virtual_stage=opts["vpp"] or None,
            parallelize_part=parallelize_part, tp_mesh=tp_mesh, sequence_parallel=sp,
        )
        parts = pipe.parts
    else:
        parts = [parallelize_part(model)]
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    opts_per_part = [torch.optim.AdamW([p for p in part.parameters() if p.requires_grad], lr=LR) for part in parts]
    if opts["load"]:
        load_checkpoint(parts, opts_per_part, opts["load"])
    out = []
    first_step = opts.get("start", 0)
    for step in range(first_step, first_step + opts["steps"]):
        ids, labels = batches(step)
        global_tokens = int((labels != -100).sum())
        rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
        ids, labels = ids[rows], labels[rows]
        pos = torch.arange(SEQ).expand(ids.shape[0], SEQ)
        if pipe is not None:
            loss = pipe.step(ids, labels, pos, None, float(global_tokens))
        else:
            loss = torch.zeros(())
            for mb in range(n_micro):
                sl = slice(mb * MICRO_BATCH, (mb + 1) * MICRO_BATCH)
                hidden = model(ids[sl], position_ids=pos[sl], return_hidden=True)
                weight = model.output_weight()
                ce = vocab_parallel_cross_entropy if tp_mesh.size() > 1 else chunked_cross_entropy
                loss_sum, _ = ce(hidden, weight, labels[sl])
                (loss_sum / global_tokens).backward()
                loss += loss_sum.detach() / global_tokens
        norm = pipeline_grad_norm(total_grad_norm(norm_parameters(parts)), pp_mesh)
        clip_grads(params, CLIP, norm)
        for o in opts_per_part:
            o.step()
            o.zero_grad()
        dist.all_reduce(loss, group=pp_mesh.get_group())
        dist.all_reduce(loss, group=dp_mesh.get_group())
        out.append((float(loss), float(norm)))
        if opts["save_at"] and step + 1 == opts["save_at"]:
            save_checkpoint(parts, opts_per_part, opts["ckpt"])
    return out


def _state(parts: list, optims: list) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    for part, opt in zip(parts, optims):
        msd, osd = get_state_dict(part, opt, options=options)
        merged.update({f"model.{k}": v for k, v in msd.items()})
        merged.update({f"optim.{k}": v for k, v in osd.items()})
    return merged


def save_checkpoint(parts: list, optims: list, path: str) -> None:
    view, _ = dcp_state_view(_state(parts, optims), parts, "save")
    dcp.save(view, checkpoint_id=path)


def load_checkpoint(parts: list, optims: list, path: str) -> None:
    view, finish = dcp_state_view(_state(parts, optims), parts, "load")
    dcp.load(view, checkpoint_id=path)
    state = finish()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    for part, opt in zip(parts, optims):
        msd, osd = get_state_dict(part, opt, options=options)
        set_state_dict(part, opt, model_state_dict={k: state[f"model.{k}"] for k in msd},
                       optim_state_dict={k: state[f"optim.{k}"] for k in osd}, options=options)


def main() -> None:
    out_path, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    results = {}
    for case in cases:
        opts = parse(case)
        entry = {"parallel": parallel(opts)}
        if not opts["load"] and dist.get_rank() == 0:
            entry["reference"] = reference(opts)
        results[opts["name"]] = entry
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
