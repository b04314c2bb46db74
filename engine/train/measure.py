"""Measured memory and reads of one training run, per rank: the other side of the planner's predictions.

``python -m engine.train.measure SPEC.json RUN_DIR [built]`` (one process, or under torchrun); with ``built`` the
run stops once every rank has built and loaded its model (start-up alone: on a CPU without bf16 instructions a
real-size bf16 iteration takes hours). Each rank starts the process
group, warms up torch and gloo (one step of a small model, an all-reduce) so their fixed costs land in the baseline,
takes the baseline RSS and I/O counters, resets the kernel's peak-RSS mark (``/proc/self/clear_refs`` 5), runs the
trainer's own entry point (``engine.train.entry.run``) and writes ``RUN_DIR/measure_rank{R}.json``: baseline RSS (the
interpreter's fixed cost), peak RSS (``VmHWM``) and its growth over the baseline, and the growth of ``/proc/self/io``
``read_bytes`` (from storage) and ``rchar`` (through read syscalls, page cache included).

Why RSS and not an allocator counter: on CPU torch keeps no allocator statistics, and RSS is what the host gives the
job (the trainer's own ``mem_max_allocated_mb`` on CPU); it also sees what a count of live tensors would miss, such as
a full model built before sharding. Callers wanting RSS to follow live tensors (a device allocator's "allocated")
rather than glibc's retained heap (its "reserved") set ``MALLOC_MMAP_THRESHOLD_`` for the run.
Torch is imported only inside ``main``: the planner package stays importable without it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from engine.contract.runfiles import RunDir
from engine.contract.spec import TrainSpec


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def io_counters() -> dict[str, int]:
    lines = Path("/proc/self/io").read_text().splitlines()
    return {k: int(v) for k, v in (line.split(": ") for line in lines)}


def warm_up() -> None:
    """One forward/backward/AdamW step of a small Qwen3 through the trainer's kernels (packed attention, chunked loss),
    so the code pages and per-thread workspaces they bring in are part of the baseline, not of the run's growth."""
    import torch

    from engine.contract.model_config import preset
    from engine.model.loss import chunked_cross_entropy
    from engine.model.qwen3 import Qwen3Model

    cfg = preset("qwen3-tiny").replace(vocab_size=1024)
    model = Qwen3Model(cfg)
    model.init_weights(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 64))
    segments = torch.zeros(1, 64, dtype=torch.long)
    positions = torch.arange(64)[None]
    hidden = model(ids, position_ids=positions, segment_ids=segments, return_hidden=True)
    loss, _ = chunked_cross_entropy(hidden, model.output_weight(), ids.roll(-1, 1), chunk_size=16)
    loss.backward()
    torch.optim.AdamW(model.parameters(), fused=True).step()


def _build_only(spec: TrainSpec, run_dir: RunDir) -> None:
    """Plan, start the process group and build this rank's trainer (model built and loaded), then stop."""
    import torch.distributed as dist

    from engine.parallel.device import init_distributed
    from engine.parallel.mesh import ensure_process_group
    from engine.train.entry import build_trainer
    from engine.train.job import plan_run

    plan = plan_run(spec, run_dir)
    device = init_distributed(spec.resources.device_type)
    ensure_process_group(device)
    build_trainer(spec, run_dir, plan, device)
    dist.barrier()
    (run_dir.path / "built.json").write_text(json.dumps({"time": time.time()}))


def main(spec_path: str, run_dir: str, until: str = "done") -> None:
    import torch
    import torch.distributed as dist

    from engine.contract.spec import TrainSpec, load_spec_file
    from engine.train.entry import run

    rank = int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
        dist.all_reduce(torch.ones(1024))
    warm_up()
    spec = load_spec_file(spec_path)
    if not isinstance(spec, TrainSpec):
        raise TypeError(f"{spec_path}: measuring needs a train spec, not {type(spec).__name__}")
    gc.collect()
    baseline, io_before = status_bytes("VmRSS"), io_counters()
    start = {
        "rank": rank,
        "pid": os.getpid(),
        "baseline_bytes": baseline,
        **{f"{k}_before": v for k, v in io_before.items()},
    }
    (Path(run_dir) / f"measure_rank{rank}.start.json").write_text(json.dumps(start))  # lets a watcher read /proc live
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    if until == "built":
        _build_only(spec, RunDir(Path(run_dir), rank))
    else:
        run(spec, RunDir(Path(run_dir), rank))
    peak, io_after = status_bytes("VmHWM"), io_counters()
    out: dict[str, Any] = {
        "rank": rank,
        "baseline_bytes": baseline,
        "peak_bytes": peak,
        "growth_bytes": peak - baseline,
        "read_bytes": io_after["read_bytes"] - io_before["read_bytes"],
        "rchar": io_after["rchar"] - io_before["rchar"],
    }
    (Path(run_dir) / f"measure_rank{rank}.json").write_text(json.dumps(out))
    sys.stdout.flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:4])
