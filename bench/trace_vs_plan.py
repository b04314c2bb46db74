"""The planner against the device trace at real size: ``python -m engine trace`` (the job's step on fake ``npu``
tensors with a fake process group, torch_npu's fused kernels as fake ops, MemTracker's peak) beside
``python -m engine plan``'s figure, per layout of the issue's table that traces.

Each row runs the trace in its own process (the private-use backend is renamed once per process) and reports the
largest traced peak over the ranks, the planner's figure for that rank, the largest ``|planner / trace - 1|`` over
all ranks, host tensors and syncs inside the step, the trace's wall time and peak host RSS.

Rows (Qwen3-4B, bf16, distributed optimizer, MBS 8 at seq 800): the seed's full-SFT line TP1 PP2 on 2 ranks (GBS 24:
three micro-batches, the fewest where 1F1B's stage 0 holds two in flight after a backward made the gradients; the
seed's 16 only repeat that pattern), the seed's LoRA line (TP1 PP2, seq 2048, MBS 4, GBS 12: three micro-batches),
8 ranks as TP1 PP1 DP8, as TP8, as TP2 PP2 DP2 and as Ulysses CP2 TP2 PP2 (GBS 24); Qwen3-8B as TP4 PP2 (GBS 24);
Qwen3-30B-A3B as EP8 over DP8 (seq 4096, MBS 1, balanced routing); Qwen3-4B DPO over DP2 (MBS 2 pairs, GBS 8, the
reference model in the step); a Qwen3-4B serve job (32 slots × 8,192 positions, its largest step). What does not
trace is in ``NOT_TRACED`` (the last line lists it). ``--rows`` picks some;
``--smoke`` (CI, under a minute): a 2-layer model as DP2 and PP2.

    python bench/trace_vs_plan.py                    # the real-size table (minutes of CPU per row)
    python bench/trace_vs_plan.py --rows seed_full_tp1_pp2
    python bench/trace_vs_plan.py --smoke

Prints one JSON line per row, then ``{"bench": "trace_vs_plan", "rows": [...], "max_abs_planner_vs_trace": ...}``.
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
MIB = 2**20

QWEN3_4B_SFT = ["--model", "qwen3-4b", "--seq-length", "800", "--micro-batch-size", "8", "--bf16"]
ROWS: dict[str, list[str]] = {
    "seed_full_tp1_pp2": [*QWEN3_4B_SFT, "--nproc-per-node", "2", "--pipeline-model-parallel-size", "2",
                          "--global-batch-size", "24", "--use-distributed-optimizer"],
    "qwen3_4b_dp8": [*QWEN3_4B_SFT, "--nproc-per-node", "8", "--global-batch-size", "64",
                     "--use-distributed-optimizer"],
    "qwen3_4b_tp8": [*QWEN3_4B_SFT, "--nproc-per-node", "8", "--tensor-model-parallel-size", "8",
                     "--global-batch-size", "16", "--use-distributed-optimizer"],
    "qwen3_4b_tp2_pp2_dp2": [*QWEN3_4B_SFT, "--nproc-per-node", "8", "--tensor-model-parallel-size", "2",
                             "--pipeline-model-parallel-size", "2", "--global-batch-size", "48",
                             "--use-distributed-optimizer"],
    "qwen3_4b_cp2_tp2_pp2": [*QWEN3_4B_SFT, "--nproc-per-node", "8", "--context-parallel-size", "2",
                             "--context-parallel-algo", "ulysses_cp_algo", "--tensor-model-parallel-size", "2",
                             "--pipeline-model-parallel-size", "2", "--global-batch-size", "24",
                             "--use-distributed-optimizer"],
    "seed_lora_tp1_pp2": ["--model", "qwen3-4b", "--seq-length", "2048", "--micro-batch-size", "4", "--bf16",
                          "--nproc-per-node", "2", "--pipeline-model-parallel-size", "2", "--global-batch-size", "12",
                          "--use-distributed-optimizer", "--lora-r", "16", "--lora-alpha", "32", "--lora-fusion",
                          "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
    "qwen3_8b_tp4_pp2": ["--model", "qwen3-8b", "--seq-length", "800", "--micro-batch-size", "8", "--bf16",
                         "--nproc-per-node", "8", "--tensor-model-parallel-size", "4",
                         "--pipeline-model-parallel-size", "2", "--global-batch-size", "24",
                         "--use-distributed-optimizer"],
    "qwen3_30b_a3b_ep8": ["--model", "qwen3-30b-a3b", "--seq-length", "4096", "--micro-batch-size", "1", "--bf16",
                          "--nproc-per-node", "8", "--expert-model-parallel-size", "8", "--global-batch-size", "8",
                          "--use-distributed-optimizer"],
    "qwen3_4b_dpo_dp2": ["--model", "qwen3-4b", "--seq-length", "800", "--micro-batch-size", "2", "--bf16",
                         "--nproc-per-node", "2", "--global-batch-size", "8", "--use-distributed-optimizer",
                         "--stage", "dpo", "--is-pairwise-dataset"],
    "qwen3_4b_serve": ["--model", "qwen3-4b", "--spec", "SERVE_SPEC"],
}  # fmt: skip
# the serve row's spec (a JSON file written per run: the flags' parser is training's)
SERVE_SPEC = {
    "kind": "serve",
    "load": "unused-by-trace",
    "bf16": True,
    "max_num_seqs": 32,
    "max_model_len": 8192,
    "resources": {"device_type": "npu", "nproc_per_node": 1},
}
# rows of the table that do not trace yet, and why (docs/device-trace.md)
NOT_TRACED = {
    "cuda (every row)": "needs a CUDA build of torch and a visible GPU: autograd over fake CUDA tensors needs a context",
}
TINY = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32", "--padded-vocab-size", "512",
        "--untie-embeddings-and-output-weights", "--seq-length", "128", "--micro-batch-size", "2", "--bf16",
        "--use-distributed-optimizer", "--nproc-per-node", "2"]  # fmt: skip
SMOKE = {
    "tiny_dp2": [*TINY, "--global-batch-size", "4"],
    "tiny_pp2": [*TINY, "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
}


def _stage(r: dict[str, Any]) -> dict[str, Any]:
    mib = {"peak_mib": round(r["peak_bytes"] / MIB), "planner_mib": round(r["planner_bytes"] / MIB)}
    return {"rank": r["rank"], **mib, "planner_vs_trace": r["planner_vs_trace"]}


def trace(name: str, flags: list[str]) -> dict[str, Any]:
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "serve.json"
        spec.write_text(json.dumps(SERVE_SPEC))
        args = [str(spec) if f == "SERVE_SPEC" else f for f in flags]
        run = subprocess.run(
            [sys.executable, "-m", "engine", "trace", "--device-type", "npu", *args, "--data-root", tmp],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        )
    if run.returncode:
        return {"row": name, "error": (run.stderr or run.stdout).strip().splitlines()[-1][:500]}
    out = json.loads(run.stdout.strip().splitlines()[-1])
    worst = max(out["ranks"], key=lambda r: r["peak_bytes"])
    return {
        "row": name,
        "traced_peak_mib": round(worst["peak_bytes"] / MIB),
        "planner_mib": round(worst["planner_bytes"] / MIB),
        "planner_vs_trace": worst["planner_vs_trace"],
        "per_stage": [_stage(r) for r in out["ranks"] if r["traced_as"] == r["rank"]],
        "max_abs_planner_vs_trace": out["max_abs_planner_vs_trace"],
        "host_tensors": out["host_tensors"],
        "host_syncs": sum(sum(r["host_syncs"].values()) for r in out["ranks"] if r["traced_as"] == r["rank"]),
        "wall_s": round(time.monotonic() - start, 1),
        "host_max_rss_mib": out["host_max_rss_mib"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model as DP2 and PP2 (CI, under a minute)")
    parser.add_argument("--rows", help=f"comma-separated subset of {', '.join(ROWS)}")
    args = parser.parse_args()
    table = SMOKE if args.smoke else ROWS
    names = args.rows.split(",") if args.rows else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; known: {', '.join(table)}")
    rows = []
    for name in names:
        row = trace(name, table[name])
        print(json.dumps(row), flush=True)
        rows.append(row)
    gaps = [abs(r["max_abs_planner_vs_trace"]) for r in rows if r.get("max_abs_planner_vs_trace") is not None]
    print(
        json.dumps(
            {
                "bench": "trace_vs_plan",
                "smoke": args.smoke,
                "rows": [{k: r.get(k) for k in ("row", "traced_peak_mib", "planner_mib", "error")} for r in rows],
                "max_abs_planner_vs_trace": max(gaps) if gaps else None,
                "failed": [r["row"] for r in rows if "error" in r],
                "not_traced": {} if args.smoke else NOT_TRACED,
            }
        )
    )
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
