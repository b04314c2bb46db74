"""``python -m engine trace``: the flags and ``--spec`` of ``python -m engine plan``, every rank's step traced on fake
tensors of ``--device-type`` (cuda, npu), next to the planner's figure. Prints one row per traced rank and ends with
one JSON line ``{"ranks": [{"rank": 0, "peak_bytes": ..., "planner_bytes": ..., "planner_vs_trace": ...}, ...]}``.
Each rank also has its host peak over the step (``host_peak_bytes``: the optimizer state ``optimizer_cpu_offload``
keeps there and the host step's fp32 slices) beside the planner's ``planner_host_bytes``.

Ranks: by default one per pipeline stage (TP rank 0, DP rank 0), the others reported as that rank's figure (its
``traced_as``): TP ranks hold equal shards (heads, FFN width and vocabulary divide by TP; the layout check refuses
the rest), FSDP2 pads every rank's shard to one size, and every DP/CP rank's micro-batch has the worst case's shape.
``--all-ranks`` traces every rank anyway.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any

from pydantic import ValidationError

from engine.contract.layout import LayoutError, ParallelDims
from engine.contract.plan.cli import _spec_from_args, default_data_root, own_parser, parse_command
from engine.contract.plan.memory import MIB
from engine.contract.plan.planner import plan_spec
from engine.contract.spec import ServeSpec, TrainSpec, first_error


def traced_ranks(dims: ParallelDims, all_ranks: bool) -> dict[int, int]:
    """rank -> the rank whose trace stands for it (itself under ``all_ranks``): the first rank of its stage."""
    per_stage = dims.tp
    return {r: r if all_ranks else (r // per_stage) % dims.pp * per_stage for r in range(dims.world_size)}


def trace_spec(spec: TrainSpec | ServeSpec, model: str | None, all_ranks: bool = False) -> dict[str, Any]:
    """The trace of every rank of a training (or serve) spec, beside the planner's figures (one JSON object)."""
    from engine.trace.backend import prepare
    from engine.trace.step import trace_rank

    started = time.perf_counter()
    plan = plan_spec(spec, model)
    prepare(spec.resources.device_type)
    if isinstance(spec, ServeSpec):
        from engine.trace.serve import trace_serve

        traced = trace_serve(spec, plan.cfg)
        stand_in = dict.fromkeys(range(spec.resources.world_size), 0)
        traces = {0: traced}
    else:
        dims = spec.parallel_dims
        gbs = spec.effective_global_batch_size
        stand_in = traced_ranks(dims, all_ranks)
        traces = {r: trace_rank(spec, plan.cfg, dims, gbs, r) for r in sorted(set(stand_in.values()))}
    rows = []
    for rank, planned in enumerate(plan.ranks):
        t = traces[stand_in[rank]]
        row = {**t.as_json(), "rank": rank, "traced_as": stand_in[rank], "planner_bytes": planned.total_bytes}
        row["planner_vs_trace"] = round(planned.total_bytes / t.peak_bytes - 1, 4) if t.peak_bytes else None
        row["planner_host_bytes"] = planned.host  # the offloaded optimizer state (and its step's slices)
        offloaded = planned.host and t.host_peak_bytes  # else the host holds only the step counters' scalars
        row["host_planner_vs_trace"] = round(planned.host / t.host_peak_bytes - 1, 4) if offloaded else None
        rows.append(row)
    gaps = [abs(r["planner_vs_trace"]) for r in rows if r["planner_vs_trace"] is not None]
    return {
        "ranks": rows,
        "max_peak_bytes": max(r["peak_bytes"] for r in rows),
        "max_abs_planner_vs_trace": max(gaps) if gaps else None,
        "host_tensors": sum(t.host_tensors for t in traces.values()),
        "device_type": spec.resources.device_type,
        "wall_s": round(time.perf_counter() - started, 1),
        "host_max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def _table(out: dict[str, Any]) -> str:
    lines = ["rank  as  peak MiB  planner MiB  planner/trace-1  host MiB  planner host MiB  host tensors"]
    for r in out["ranks"]:
        lines.append(
            f"{r['rank']:>4}  {r['traced_as']:>2}  {r['peak_bytes'] / MIB:>8,.0f}  {r['planner_bytes'] / MIB:>11,.0f}  "
            f"{r['planner_vs_trace']:>+15.3f}  {r['host_peak_bytes'] / MIB:>8,.0f}  "
            f"{r['planner_host_bytes'] / MIB:>16,.0f}  {r['host_tensors']:>12}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    own = own_parser("python -m engine trace")
    own.add_argument("--device-type", choices=("cuda", "npu"), default="npu")
    own.add_argument("--data-root", default=default_data_root())
    own.add_argument("--all-ranks", action="store_true", help="trace every rank, not one per pipeline stage")
    opts, flags, resources, _ = parse_command(own, argv)
    if opts.help:
        print(__doc__)
        return 0
    resources["device_type"] = opts.device_type
    try:
        spec = _spec_from_args("train", flags, resources, opts.data_root)
        if not isinstance(spec, TrainSpec | ServeSpec):
            print("error: kind: the trace runs training and serve jobs", file=sys.stderr)
            return 2
        out = trace_spec(spec, opts.model, opts.all_ranks)
    except ValidationError as err:
        print(f"error: {first_error(err, 'spec')}", file=sys.stderr)
        return 2
    except (ValueError, OSError, LayoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if opts.device_memory_gib:
        out["device_memory_bytes"] = int(opts.device_memory_gib * 2**30)
        out["fits"] = out["max_peak_bytes"] <= out["device_memory_bytes"]
    print(_table(out))
    print(json.dumps(out))
    return 0
