"""Step time of each TP / PP / DP layout against one process, on gloo (CPU), through the trainer's ``train_step``.

Runs ``tests/integration/parallel_worker.py`` under torchrun (2 and 4 processes, OMP_NUM_THREADS=1): each layout
trains a Qwen3-shaped model (4 layers, hidden 64·scale, vocab 256, global batch 8 × 33 tokens, micro-batch 2, fp32)
for ``--steps`` steps, and rank 0 trains the same model single-process on the same batches. Reported per layout:
median step wall time (first step excluded: schedule set-up, shape inference) and the worst relative loss difference
from one process. On CPU the figures measure framework overhead (DTensor dispatch, gloo), not accelerator scaling.

    .venv/bin/python bench/parallel_layouts.py [--scale 4] [--steps 8]

Last line: {"bench":"parallel_layouts","layouts":{name: {"procs", "step_ms", "one_process_ms", "max_rel_loss_diff"}}}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from torchrun_support import torchrun  # noqa: E402

WORKER = ROOT / "tests" / "integration" / "parallel_worker.py"
LAYOUTS = {
    2: ["tp2:tp=2", "tp2_nosp:tp=2,sp=0", "pp2:pp=2", "pp2_interleaved:pp=2,vpp=1", "dp2:dp=2"],
    4: ["tp2pp2:tp=2,pp=2", "tp2dp2:tp=2,dp=2", "pp2dp2:pp=2,dp=2"],
}


def launch(nproc: int, cases: list[str], out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = torchrun(nproc, str(WORKER), str(out), *cases)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="PP2 and DP2 only, scale 1, 3 steps: the same code path")
    args = parser.parse_args()
    layouts_by_procs = LAYOUTS
    if args.smoke:
        args.scale, args.steps, layouts_by_procs = 1, 3, {2: ["pp2:pp=2", "dp2:dp=2"]}
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc, layouts in layouts_by_procs.items():
            cases = [f"{c},layers=4,scale={args.scale},steps={args.steps}" for c in layouts]
            for name, entry in launch(nproc, cases, Path(tmp) / f"{nproc}.json").items():
                par, ref = entry["parallel"], entry["reference"]
                report[name] = {
                    "procs": nproc,
                    "step_ms": round(1000 * statistics.median(s[2] for s in par[1:]), 1),
                    "one_process_ms": round(1000 * statistics.median(s[2] for s in ref[1:]), 1),
                    "max_rel_loss_diff": max(abs(p[0] - r[0]) / abs(r[0]) for p, r in zip(par, ref)),
                }
                print(
                    f"{name:16s} {nproc} procs  step {report[name]['step_ms']:8.1f} ms   one process "
                    f"{report[name]['one_process_ms']:8.1f} ms   loss rel diff {report[name]['max_rel_loss_diff']:.1e}"
                )
    print(json.dumps({"bench": "parallel_layouts", "smoke": args.smoke, "layouts": report}))


if __name__ == "__main__":
    main()
