"""Optimizer step time and memory: torch's AdamW vs the precision-aware AdamW (bf16 moments; bf16 weights and grads
with an fp32 master) and its CPU offload (``engine.train.precision_optimizer``), on the same parameters.

Each side runs in a process of its own (its peak RSS is its own), the sides alternating A/B/C… for ``--repeats``
rounds; a side's figures are the medians over its rounds: the step time (median of ``--steps`` timed steps after one
warm-up step, which creates the state) and the peak RSS above the process's RSS once parameters and gradients exist
(the optimizer state plus the step's temporaries), with the state's own bytes counted from its tensors. On this
CPU "offload" moves nothing (host and device are one memory): it measures the extra master copy and the slice loop.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common.allocator import add_malloc_flag, malloc_env  # noqa: E402
from engine.train.precision_optimizer import PrecisionAwareAdamW, StateDtypes  # noqa: E402

SIDES: dict[str, dict[str, Any]] = {
    "torch_adamw": {},
    "bf16_moments": {"dtypes": StateDtypes(torch.float32, torch.bfloat16, torch.bfloat16)},
    "bf16_grads_moments": {"dtypes": StateDtypes(torch.float32, torch.bfloat16, torch.bfloat16), "weights": "bf16"},
    "offload_1.0": {"dtypes": StateDtypes(torch.float32, torch.bfloat16, torch.bfloat16), "offload": 1.0},
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_side(side: str, numel: int, steps: int, seed: int) -> dict[str, float]:
    """One side in this process: parameters of ``numel`` elements in 4 tensors, ``steps`` timed steps."""
    cfg = SIDES[side]
    dtype = torch.bfloat16 if cfg.get("weights") == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(numel // 4, generator=gen).to(dtype).requires_grad_() for _ in range(4)]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype)
    base = _rss_bytes()
    opt: torch.optim.Optimizer
    if side == "torch_adamw":
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True)
    else:
        opt = PrecisionAwareAdamW(
            params, lr=1e-4, weight_decay=0.1, dtypes=cfg["dtypes"], offload_fraction=cfg.get("offload", 0.0)
        )
    opt.step()  # creates the state
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state = sum(t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    return {"step_s": statistics.median(times), "peak_above_params_bytes": peak - base, "state_bytes": state}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="parameter elements (4 tensors)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="64K elements, 2 steps, 1 round")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process
    add_malloc_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.numel, args.steps, args.repeats = 2**16, 2, 1
    if args.side:
        print(json.dumps(run_side(args.side, args.numel, args.steps, args.seed)))
        return
    rounds: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    env = {**os.environ, **malloc_env(args.malloc)}
    for _ in range(args.repeats):
        for side in SIDES:  # alternating sides: drift in the machine's speed hits every side alike
            cmd = [sys.executable, __file__, "--side", side, "--numel", str(args.numel), "--steps", str(args.steps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            rounds[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result: dict[str, object] = {"bench": "optimizer_step", "numel": args.numel, "smoke": args.smoke}
    for side, figures in rounds.items():
        med = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
        result[side] = med
        print(
            f"{side:<20} step {med['step_s'] * 1e3:8.1f} ms  state {med['state_bytes'] / args.numel:5.2f} B/param  "
            f"peak above params {med['peak_above_params_bytes'] / 2**20:8.1f} MiB"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
