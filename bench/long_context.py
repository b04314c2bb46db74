"""Long sequences: the planner's Qwen3-4B full-SFT table at 32K and 128K tokens on 8 × 64 GiB, and a measured CP2
vs CP1 step on this CPU.

1. Planner (``engine.contract.plan``): Qwen3-4B, bf16, full fine-tuning, distributed optimizer, one sample per
   micro-batch of ``seq_length`` tokens (128K with YaRN 4 × 32K), 8 NPUs of 64 GiB: every CP (Ulysses and ring) ×
   TP × recompute layout of the 8 ranks, as ``python -m engine plan --suggest`` plans them; the lowest peak that
   fits and the planner's first suggestion (cheapest recompute, then fewest ranks per sequence) are reported.
2. Measured: a hidden-256, 4-layer Qwen3 (8 heads, 4 KV groups), one packed text sample of ``--seq`` tokens per
   step, fp32, trained 3 steps by ``python -m engine train`` in one process and on two CP ranks (torchrun, gloo),
   Ulysses and ring. ``peak_mem_ratio`` (the larger of the two algorithms') = the largest CP2 rank's peak allocated
   memory over the one process's, fixed costs included (the
   Python process with torch, the weights and the optimizer state, which CP does not split: with these small weights
   they are most of what stays); ``loss_equal`` compares the two runs' losses (rel 1e-5).

   Both sides run with glibc's mmap threshold pinned at 128 KiB (``bench/common/allocator.py``: RSS then follows the
   live tensors; under glibc's adaptive threshold CP's halved activations fall under it and stay in its heaps, a
   penalty the device allocators CP is for do not have); ``--malloc default`` measures glibc's own.

Prints the table and the two runs, then ``{"bench": "long_context", ...}``. ``--smoke``: 512 tokens, planner at 32K.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from engine.contract.indexed import IndexedDatasetWriter  # noqa: E402
from engine.contract.plan.suggest import candidates  # noqa: E402
from engine.contract.spec import TrainSpec, parse_spec  # noqa: E402
from bench.common.allocator import add_malloc_flag, malloc_env  # noqa: E402
from train_support import QWEN3_4B  # noqa: E402

GIB = 2**30
YARN = {
    "rope_scaling_type": "yarn",
    "rope_scaling_factor": 4.0,
    "rope_scaling_original_max_position_embeddings": 32768,
}


def planner_rows(seq: int) -> list[dict[str, Any]]:
    """Every CP × TP × recompute layout of the 8 ranks (``engine.contract.plan.suggest``, as ``python -m engine plan
    --suggest``), ranked as it ranks them."""
    spec = {
        "kind": "train", "data_path": ["d"], "train_iters": 1, "lr": 1e-5, "bf16": True,
        "seq_length": seq, "micro_batch_size": 1, "global_batch_size": 8, "use_distributed_optimizer": True,
        "resources": {"device_type": "npu", "nproc_per_node": 8}, **QWEN3_4B, **(YARN if seq > 32768 else {}),
    }  # fmt: skip
    rows = []
    for c in candidates(cast(TrainSpec, parse_spec(spec)), None, 64 * GIB):
        row: dict[str, Any] = {"seq": seq, "cp": c.cp, "algo": c.algo, "tp": c.tp, "recompute": c.recompute}
        if c.peak_bytes is None:
            rows.append({**row, "refused": (c.refused or "")[:120]})
        else:
            rows.append({**row, "peak_gib": round(c.peak_bytes / GIB, 1), "fits": c.fits})
    return rows


def write_text(prefix: Path, tokens: int, docs: int, vocab: int) -> str:
    """``docs`` documents of exactly ``tokens`` tokens: one ``seq_length`` row each (a document one token longer
    would be two rows, the second a one-target window)."""
    rng = np.random.default_rng(0)
    writer = IndexedDatasetWriter(str(prefix) + "_text_document")
    for _ in range(docs):
        writer.add_document(rng.integers(1, vocab, tokens))
    writer.finalize()
    return str(prefix)


def run(spec: dict[str, Any], run_dir: Path, nproc: int, malloc_env: dict[str, str]) -> list[dict[str, Any]]:
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = [*(head if nproc > 1 else [sys.executable]), "-m", "engine", "train"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **malloc_env}
    proc = subprocess.run(
        [*cmd, "--spec", str(run_dir / "spec.json"), "--run-dir", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"engine train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def measured(seq: int, steps: int, algos: list[str], malloc_env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="llmjobs-long-") as tmp:
        data = write_text(Path(tmp) / "text", seq, docs=steps, vocab=4096)
        spec = {
            "kind": "train", "data_path": [data], "split": "100,0,0", "train_iters": steps, "lr": 1e-3,
            "seq_length": seq, "micro_batch_size": 1, "global_batch_size": 1, "log_interval": 1, "eval_iters": 0,
            "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 768, "num_attention_heads": 8,
            "group_query_attention": True, "num_query_groups": 4, "kv_channels": 32, "padded_vocab_size": 4096,
            "max_position_embeddings": max(seq, 4096), "seed": 1,
        }  # fmt: skip
        cp2 = {"context_parallel_size": 2, "resources": {"nproc_per_node": 2}}
        names = {"ulysses": "ulysses_cp_algo", "ring": "megatron_cp_algo"}
        runs = {"cp1": run(spec, Path(tmp) / "cp1", 1, malloc_env)}
        for name in algos:
            runs[name] = run({**spec, **cp2, "context_parallel_algo": names[name]}, Path(tmp) / name, 2, malloc_env)
    peaks = {name: max(r["mem_max_allocated_mb"] for r in rows[-1]["rank_metrics"].values())
             for name, rows in runs.items()}  # fmt: skip
    fixed = min(r["mem_allocated_mb"] for r in runs["cp1"][0]["rank_metrics"].values())
    losses = {name: [r["metrics"]["lm_loss"] for r in rows] for name, rows in runs.items()}
    equal = all(
        abs(a - b) <= 1e-5 * abs(a)
        for name in algos
        for a, b in zip(losses["cp1"], losses[name], strict=True)
    )
    return {
        "seq": seq, "steps": steps, "malloc": malloc_env or "glibc default",
        **{f"{name}_peak_mb": round(p, 1) for name, p in peaks.items()},
        **{f"peak_mem_ratio_{name}": round(peaks[name] / peaks["cp1"], 3) for name in algos},
        "cp1_after_step_mb": round(fixed, 1), "loss_equal": equal, "losses": losses,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192, help="tokens of the measured sample")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="512 tokens, 2 steps, the planner at 32K only")
    parser.add_argument(
        "--algo", choices=("ulysses", "ring"), action="append", help="measure only these CP algorithms (default both)"
    )
    add_malloc_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.steps = 512, 2
    table = []
    for seq in (32768,) if args.smoke else (32768, 131072):
        rows = planner_rows(seq)
        table += rows
        for row in rows:
            print(json.dumps(row), flush=True)
    best, suggested = {}, {}
    for seq in sorted({r["seq"] for r in table}):
        fitting = [r for r in table if r["seq"] == seq and r.get("fits")]
        best[seq] = min(fitting, key=lambda r: r["peak_gib"]) if fitting else None
        suggested[seq] = fitting[0] if fitting else None  # the planner's first suggestion
    algos = args.algo or ["ulysses", "ring"]
    result = measured(args.seq, args.steps, algos, malloc_env(args.malloc))
    print(json.dumps(result), flush=True)
    print(json.dumps({
        "bench": "long_context", "smoke": args.smoke,
        "best_fit": {str(k): v for k, v in best.items()}, "suggested": {str(k): v for k, v in suggested.items()},
        "no_cp_no_recompute_peak_gib": {str(s): next(r["peak_gib"] for r in table if r["seq"] == s and r["cp"] == 1
                                                    and r["tp"] == 1 and r["recompute"] == "none") for s in best},
        "peak_mem_ratio": max(result[f"peak_mem_ratio_{name}"] for name in algos),
        **{f"peak_mem_ratio_{name}": result[f"peak_mem_ratio_{name}"] for name in algos},
        "loss_equal": result["loss_equal"], "seq": result["seq"], "malloc": args.malloc,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
