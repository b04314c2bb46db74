"""The demo SFT's loss curve with fp32 Adam vs the precision-aware optimizer (issue 42): bf16 moments, and bf16
moments with bf16 main grads. Each run is the README's ``examples/02-train-full.json`` on the demo data and model
(``cli.demo.prepare_demo``: the intent set, the tiny Qwen3 with the real vocabulary), bf16 compute, ``--steps``
iterations, the same seed and data order; only the optimizer's dtypes differ. Writes the curves (JSON) and an SVG of
them, prints the largest relative gap of each run's loss to fp32 Adam's, and ends with one JSON line.

Run: ``python bench/precision_curves.py [--steps 100] [--svg docs/precision-curves.svg]``; ``--smoke``: 2 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from cli.demo import demo_spec, prepare_demo  # noqa: E402

BF16_MOMENTS = {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
RUNS: dict[str, dict[str, Any]] = {
    "fp32 Adam": {},
    "bf16 moments": BF16_MOMENTS,
    "bf16 moments + bf16 grads": {**BF16_MOMENTS, "main_grads_dtype": "bf16"},
}
COLOURS = ("#1f77b4", "#d62728", "#2ca02c")


def engine(command: str, spec: dict[str, Any], run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "engine", command, "--spec", str(run_dir / "spec.json"), "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{command} failed:\n{proc.stderr[-3000:]}")


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [float(r["lm_loss"]) for r in rows if r.get("lm_loss") is not None]


def train_spec(demo: Path, steps: int, flags: dict[str, Any]) -> dict[str, Any]:
    spec = json.loads((REPO / "examples" / "02-train-full.json").read_text())
    spec.update(
        data_path=[str(demo / "out" / "intent")],
        load=str(demo / "qwen3-tiny"),
        train_iters=steps,
        bf16=True,
        split="100,0,0",
        seed=1234,
        **flags,
    )
    for key in ("save", "save_interval", "eval_interval", "eval_iters", "name"):
        spec.pop(key, None)
    return spec


def svg(curves: dict[str, list[float]], title: str, width: int = 640, height: int = 360) -> str:
    """A hand-written SVG: one polyline per curve, axes with a few ticks, a legend."""
    left, right, top, bottom = 56, 16, 28, 40
    values = [v for c in curves.values() for v in c]
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.05 or 0.1
    lo, hi = lo - pad, hi + pad
    steps = max(len(c) for c in curves.values())
    x = lambda i: left + (width - left - right) * i / max(steps - 1, 1)  # noqa: E731
    y = lambda v: top + (height - top - bottom) * (hi - v) / (hi - lo)  # noqa: E731
    out = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
            'font-size="11">'
        ),
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>',
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 6}" text-anchor="middle">iteration</text>',
        f'<text x="14" y="{height / 2}" text-anchor="middle" transform="rotate(-90 14 {height / 2})">lm loss</text>',
    ]
    for k in range(6):
        v = lo + (hi - lo) * k / 5
        out.append(f'<text x="{left - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{width - right}" y2="{y(v):.1f}" stroke="#eee"/>')
    for k in range(5):
        i = round((steps - 1) * k / 4)
        out.append(f'<text x="{x(i):.1f}" y="{height - bottom + 14}" text-anchor="middle">{i + 1}</text>')
    for n, (name, curve) in enumerate(curves.items()):
        colour = COLOURS[n % len(COLOURS)]
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(curve))
        dash = ' stroke-dasharray="5,3"' if n else ""
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5"{dash} points="{points}"/>')
        ly = top + 14 + 16 * n
        out.append(f'<line x1="{width - 230}" y1="{ly}" x2="{width - 206}" y2="{ly}" stroke="{colour}"{dash}/>')
        out.append(f'<text x="{width - 200}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--work", type=Path, help="working folder (default: a temporary one)")
    parser.add_argument("--svg", type=Path, help="write the curves' SVG here")
    parser.add_argument("--curves", type=Path, help="write the curves' JSON here")
    parser.add_argument("--smoke", action="store_true", help="2 steps")
    parser.add_argument(
        "--only", choices=list(RUNS), help="train this run alone (runs may go side by side in one --work)"
    )
    args = parser.parse_args()
    if args.work:
        run(args, args.work)
        return
    with tempfile.TemporaryDirectory(prefix="precision-curves-") as work:
        run(args, Path(work))


def run(args: argparse.Namespace, work: Path) -> None:
    steps = 2 if args.smoke else args.steps
    demo = prepare_demo(work)
    prep = {**demo_spec(), "input": str(demo / "intent_train.jsonl"), "output_prefix": str(demo / "out" / "intent")}
    prep["tokenizer_name_or_path"] = str(demo / "qwen3-tokenizer")
    if not list((demo / "out").glob("intent*.bin")):  # preprocessed once per working folder
        engine("preprocess", prep, work / "runs" / "preprocess")
    curves = {}
    for name, flags in RUNS.items():
        if args.only and name != args.only:
            continue
        run_dir = work / "runs" / name.replace(" ", "_").replace("+", "and")
        done = (run_dir / "metrics.jsonl").exists() and len(losses(run_dir)) == steps
        if not done:  # a finished run in the working folder is read, not repeated
            engine("train", train_spec(demo, steps, flags), run_dir)
        curves[name] = losses(run_dir)
    if args.only:
        print(
            json.dumps({"bench": "precision_curves", "steps": steps, "only": args.only, "lm_loss": curves[args.only]})
        )
        return
    ref = curves["fp32 Adam"]
    gaps = {
        name: max(abs(a - b) / abs(b) for a, b in zip(curve, ref, strict=True))
        for name, curve in curves.items()
        if name != "fp32 Adam"
    }
    for name, gap in gaps.items():
        print(f"{name:<28} max |loss - fp32 Adam's| / fp32 Adam's over {steps} steps: {gap * 100:.3f} %")
    if args.curves:
        args.curves.write_text(json.dumps({"steps": steps, "lm_loss": curves}, indent=1) + "\n")
    if args.svg:
        args.svg.write_text(svg(curves, f"demo SFT, {steps} iterations: fp32 Adam vs the precision-aware optimizer"))
    result = {
        "bench": "precision_curves",
        "steps": steps,
        "smoke": args.smoke,
        "max_rel_gap": gaps,
        "first_loss": ref[0],
        "last_loss": {name: c[-1] for name, c in curves.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
