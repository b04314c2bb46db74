"""The planner against the device: per-rank peak that ``python -m engine plan`` predicts vs what the real job
(``python -m engine train``) allocates, at real size on one accelerator.

Cases (one rank, bf16, distributed optimizer, one sample of ``seq`` random tokens per step, 4 steps, the final
export included): Qwen3-4B at 4K without recompute, at 16K with selective recompute, at 32K with full recompute;
the Qwen3-30B-A3B layer shape (128 experts, top-8) cut to 4 layers at 4K. Measured: the job's own
``mem_max_allocated_mb`` (the device allocator's peak; on CPU peak RSS) and ``mem_reserved_mb`` (what the caching
allocator holds), tokens/s and MFU. ``measured_over_planned`` below 1 means the planner errs on the safe side.

    python bench/plan_vs_device.py --device-type cuda          # the four cases (an 80+ GiB device)
    python bench/plan_vs_device.py --smoke                     # CI: a tiny model on the CPU, same code path

On the CPU the job's figures are process RSS, the interpreter and torch included, so the smoke run's ratio checks
nothing; ``tests/integration/test_plan_measured.py`` checks the planner on the CPU (RSS growth per rank).

Prints one JSON line per case, then ``{"bench": "plan_vs_device", ...}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from long_context import write_text  # noqa: E402

from train_support import QWEN3_4B, TINY_SHAPE  # noqa: E402

MOE_4_LAYERS = {
    "num_layers": 4, "hidden_size": 2048, "ffn_hidden_size": 6144, "num_attention_heads": 32,
    "group_query_attention": True, "num_query_groups": 4, "kv_channels": 128, "padded_vocab_size": 151936,
    "num_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 768,
}  # fmt: skip
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
CASES: dict[str, tuple[dict[str, Any], int, dict[str, Any]]] = {
    "qwen3-4b_4k": (QWEN3_4B, 4096, {}),
    "qwen3-4b_16k_selective": (QWEN3_4B, 16384, {"recompute_granularity": "selective"}),
    "qwen3-4b_32k_full": (QWEN3_4B, 32768, FULL_RECOMPUTE),
    "qwen3-30b-a3b-4layers_4k": (MOE_4_LAYERS, 4096, {}),
}
SMOKE = {"tiny_256": (TINY_SHAPE, 256, {})}


def engine(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, check=False)


def measure(name: str, shape: dict[str, Any], seq: int, extra: dict[str, Any], device: str, work: Path) -> dict:
    steps = 4
    spec = {
        "kind": "train", "split": "100,0,0", "train_iters": steps, "lr": 1e-5, "bf16": device != "cpu",
        "data_path": [write_text(work / f"text{seq}", seq, steps, int(shape["padded_vocab_size"]))],
        "seq_length": seq, "micro_batch_size": 1, "global_batch_size": 1, "log_interval": 1, "eval_iters": 0,
        "use_distributed_optimizer": True, "max_position_embeddings": max(seq, 4096), "seed": 1,
        "resources": {"device_type": device, "nproc_per_node": 1}, **shape, **extra,
    }  # fmt: skip
    (work / f"{name}.json").write_text(json.dumps(spec))
    row: dict[str, Any] = {"case": name, "seq": seq, **extra}
    plan = engine("plan", "--spec", str(work / f"{name}.json"))
    if plan.returncode:
        raise SystemExit(f"{name}: plan failed:\n{plan.stdout[-2000:]}{plan.stderr[-2000:]}")
    row["planned_gib"] = round(json.loads(plan.stdout.splitlines()[-1])["ranks"][0]["total_bytes"] / 2**30, 2)
    start = time.monotonic()
    run = engine("train", "--spec", str(work / f"{name}.json"), "--run-dir", str(work / name))
    if run.returncode:
        raise SystemExit(f"{name}: train failed:\n{run.stderr[-3000:]}")
    rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    mem = [r["rank_metrics"]["0"] for r in rows]
    row |= {
        "measured_max_gib": round(max(m["mem_max_allocated_mb"] for m in mem) / 1024, 2),
        "reserved_gib": round(max(m["mem_reserved_mb"] for m in mem) / 1024, 2),
        "tokens_per_s": round(rows[-1]["metrics"]["tokens_per_s"]),
        "mfu": rows[-1]["metrics"]["mfu"],
        "iteration_ms": [round(r["metrics"]["iteration_time_ms"]) for r in rows],
        "job_s": round(time.monotonic() - start, 1),
    }
    row["measured_over_planned"] = round(row["measured_max_gib"] / row["planned_gib"], 3)
    row["reserved_over_planned"] = round(row["reserved_gib"] / row["planned_gib"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device-type", choices=("cuda", "npu", "cpu"), default="cuda")
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), help="default: all four")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args()
    cases = SMOKE if args.smoke else {k: CASES[k] for k in args.cases or CASES}
    device = "cpu" if args.smoke else args.device_type
    rows = []
    with tempfile.TemporaryDirectory(prefix="llmjobs-plan-device-") as tmp:
        for name, (shape, seq, extra) in cases.items():
            rows.append(measure(name, shape, seq, extra, device, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({
        "bench": "plan_vs_device", "smoke": args.smoke, "device_type": device,
        "measured_over_planned": {r["case"]: r["measured_over_planned"] for r in rows},
        "reserved_over_planned": {r["case"]: r["reserved_over_planned"] for r in rows},
        "max_measured_over_planned": max(r["measured_over_planned"] for r in rows),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
