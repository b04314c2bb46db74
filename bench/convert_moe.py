"""MoE conversion memory benchmark: a Qwen3-235B-A22B-shaped bf16 checkpoint at full width (hidden 4096, 128
experts of width 1536, vocab 151,936, untied head) but ``--layers`` layers, hf -> mg in MindSpeed's layout
(``--moe-grouped-gemm``, ``--target-expert-parallel-size``) and mg -> hf.

Each conversion runs as ``python -m engine convert`` in a fresh process (as a job does); the figure is its peak RSS
(VmHWM, interpreter and torch included) against the largest file it writes: streaming means one tensor (here one
layer's stacked experts, or one EP rank's block of them) in memory, not the model. The HF input is written
tensor by tensor with random bf16 values (never the whole model in memory) and kept under ``--work-dir``.

    .venv/bin/python bench/convert_moe.py [--layers 1] [--ep 1] [--work-dir /tmp/llmjobs-bench-convert-moe] [--smoke]

Last line: {"bench":"convert_moe","peak_rss_ratio":...} (the worse of the two directions).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.convert import convert, output_figures  # noqa: E402  (one conversion run and its figures, as the dense bench)


def generate(path: Path, layers: int, shape: str = "qwen3-235b-a22b") -> Path:
    """The 235B-A22B shape with ``layers`` layers as HF safetensors (one file per layer), written one tensor at a
    time with random bf16 values."""
    if (path / "config.json").is_file():
        return path
    import torch

    from engine.checkpoint.hf import expected_hf_shapes, write_safetensors
    from engine.contract.model_config import preset

    cfg = preset(shape)
    cfg = cfg.replace(num_layers=layers) if layers != cfg.num_layers else cfg
    shapes = expected_hf_shapes(cfg)
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in shapes.items():
        part = name.split(".")[2] if name.startswith("model.layers.") else "top"
        groups.setdefault(part, []).append((name, shape))
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)

    def draw(plan: list[tuple[str, tuple[int, ...]]]):  # noqa: ANN202 - (name, tensor) one at a time
        for name, shape in plan:
            yield name, torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)

    weight_map = {}
    for i, plan in enumerate(groups.values()):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(tmp / file, draw(plan), plan, torch.bfloat16)
        weight_map.update({name: file for name, _ in plan})
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf("bfloat16")))
    os.replace(tmp, path)
    return path


def measure(name: str, flags: list[str], work: Path) -> dict:
    result = convert(["--model-type-hf", "qwen3-moe", *flags], work / f"run-{name.replace(' ', '_').replace('>', '')}")
    row = {"direction": name, "seconds": result["seconds"], **output_figures(result)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    from engine.contract.model_config import preset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="/tmp/llmjobs-bench-convert-moe")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="--target-expert-parallel-size of the mcore output")
    parser.add_argument("--smoke", action="store_true", help="qwen3-moe-tiny at EP 2: the same code path in seconds")
    args = parser.parse_args()
    work = Path(args.work_dir) / ("smoke" if args.smoke else "")
    shape = "qwen3-moe-tiny" if args.smoke else "qwen3-235b-a22b"
    if args.smoke:
        args.layers, args.ep = preset(shape).num_layers, 2
    work.mkdir(parents=True, exist_ok=True)
    need = 0.1 * 2**30 if args.smoke else 3 * (2.5 + 5.0 * args.layers) * 2**30  # input, mcore output, HF output
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(f"{work}: only {free / 2**30:.1f} GiB free; the bench needs about {need / 2**30:.0f} GiB")
    hf = generate(work / f"{shape}-{args.layers}l-hf", args.layers, shape)
    mg, back = work / "mg", work / "hf-back"
    mg_flags = ["--target-expert-parallel-size", str(args.ep), "--moe-grouped-gemm"]
    rows = [
        measure(
            f"hf->mg ep{args.ep} grouped",
            ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf), "--save-dir", str(mg)]
            + mg_flags,
            work,
        ),
        measure(
            "mg->hf",
            ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg), "--save-dir", str(back)],
            work,
        ),
    ]
    shutil.rmtree(mg)
    shutil.rmtree(back)
    print(
        json.dumps(
            {
                "bench": "convert_moe",
                "smoke": args.smoke,
                "layers": args.layers,
                "ep": args.ep,
                "peak_rss_ratio": max(r["peak_rss_ratio"] for r in rows),
            }
        )
    )


if __name__ == "__main__":
    main()
