"""Conversion benchmark: a Qwen3-0.6B-shaped bf16 checkpoint, hf -> mg (TP2 PP2) and mg -> hf, against ``cp -r``.

Each conversion runs (``--repeats`` pairs, each the copy and then the conversion: ``bench/common/pairs.py``) as
``python -m engine convert`` in a fresh process (as a job does); its time is the job's own ``summary.seconds`` (open, read, convert, write; interpreter start-up excluded and reported separately) and is
compared with ``cp -r`` of the conversion's input directory in the same run, so both see the same disk and page
cache. Peak memory is the child's peak RSS (VmHWM, interpreter and torch included) against the largest file
the conversion writes. Same-dtype conversions copy most bytes as they are (``engine.checkpoint.fastcopy``), so the
figure mostly measures that copy against ``cp``'s in-kernel ``copy_file_range``, plus the zip CRCs of rank files,
the row-parallel pieces glued in memory and the extra bytes (a tied model's last stage repeats the embedding). The checkpoint is generated once (random values, ``transformers.save_pretrained``) and kept
under ``--work-dir`` for later runs.

    .venv/bin/python bench/convert.py [--work-dir /tmp/llmjobs-bench-convert] [--smoke]

Last line: {"bench":"convert","time_ratio":...,"peak_rss_ratio":...} (the worse of the two directions; the time ratio is
the median of the pairs' ratios, with their min, max and count).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import qwen3  # noqa: E402
from bench.common.pairs import alternate, pair_ratios  # noqa: E402

SHAPE: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "tie_word_embeddings": True,
}
# --smoke: the same conversions of the benches' hidden-64 stand-in (2 MB): 4 layers, so PP2 has layers to split, and
# a 1,024-token vocabulary
SMOKE_SHAPE: dict[str, Any] = {**qwen3.SMOKE_SHAPE, "num_hidden_layers": 4, "vocab_size": 1024}


def generate(path: Path, shape: dict[str, Any]) -> Path:
    """Qwen3-0.6B's published shape (or ``shape``), bf16, random values, saved by transformers (about 1.2 GB)."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()  # to_empty made lm_head its own tensor again; Qwen3-0.6B shares it with the embedding
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02))
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def copy_seconds(src: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    os.sync()  # each timed run starts with no earlier run's dirty pages still being written back
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)  # no sync: the converter does not fsync either
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


def convert(flags: list[str], run_dir: Path) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    # Like the copy's target, the output starts absent: replacing an earlier output is not part of the figure.
    shutil.rmtree(flags[flags.index("--save-dir") + 1], ignore_errors=True)
    os.sync()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "convert", *flags, "--run-dir", str(run_dir)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"convert failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "result.json").read_text())["summary"]
    return {**summary, "wall_seconds": round(wall, 3)}


def output_figures(result: dict) -> dict:
    """A conversion's peak memory against its largest output file (what a streaming conversion must hold at least),
    and its output (``bench/convert_moe.py`` reports the same)."""
    largest = result["largest_file_bytes"]
    return {
        "peak_rss_mb": result["peak_rss_mb"],
        "largest_output_mb": round(largest / 2**20, 1),
        "peak_rss_ratio": round(result["peak_rss_mb"] * 2**20 / largest, 3),
        "output_mb": round(result["bytes"] / 2**20, 1),
        "files": result["files"],
    }


def measure(name: str, src: Path, flags: list[str], work: Path, repeats: int) -> dict:
    """``repeats`` pairs of the copy and the conversion, so that a burst of load from other processes hits both alike;
    the time ratio is the median of the pairs', the memory figures the largest run's."""
    sides = {
        "cp": lambda: {"seconds": copy_seconds(src, work / "cp-target")},
        "convert": lambda: convert(flags, work / f"run-{name}"),
    }
    rounds = alternate(lambda side: sides[side](), ("cp", "convert"), repeats, log=lambda _: None)
    result = max((r["convert"] for r in rounds), key=lambda r: r["peak_rss_mb"])
    row = {
        "direction": name,
        "convert_s": [r["convert"]["seconds"] for r in rounds],
        "convert_wall_s": [r["convert"]["wall_seconds"] for r in rounds],
        "cp_s": [round(r["cp"]["seconds"], 3) for r in rounds],
        **pair_ratios("time_ratio", [r["convert"]["seconds"] / r["cp"]["seconds"] for r in rounds]),
        **output_figures(result),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="/tmp/llmjobs-bench-convert")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of the copy and the conversion")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, one pair: the same code path in seconds")
    args = parser.parse_args()
    work = Path(args.work_dir) / ("smoke" if args.smoke else "")
    if args.smoke:
        args.repeats = 1
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    if free < (0.1 if args.smoke else 6) * 2**30:
        raise SystemExit(f"{work}: only {free / 2**30:.1f} GiB free; the bench needs about 6 GiB")
    print(json.dumps({"load_average": os.getloadavg(), "cpus": os.cpu_count(), "free_gib": round(free / 2**30, 1)}))
    hf = generate(work / "qwen3-0.6b-hf", SMOKE_SHAPE if args.smoke else SHAPE)
    mg, back = work / "mg-tp2pp2", work / "hf-back"
    rows = [
        measure(
            "hf->mg tp2pp2",
            hf,
            [
                "--load-model-type",
                "hf",
                "--save-model-type",
                "mg",
                "--load-dir",
                str(hf),
                "--save-dir",
                str(mg),
                "--target-tensor-parallel-size",
                "2",
                "--target-pipeline-parallel-size",
                "2",
            ],
            work,
            args.repeats,
        ),
        measure(
            "mg->hf",
            mg,
            ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(mg), "--save-dir", str(back)],
            work,
            args.repeats,
        ),
    ]
    shutil.rmtree(mg)
    shutil.rmtree(back)
    print(json.dumps({"load_average_after": os.getloadavg()}))
    print(
        json.dumps(
            {
                "bench": "convert",
                "smoke": args.smoke,
                **{k: v for k, v in max(rows, key=lambda r: r["time_ratio"]).items() if k.startswith("time_ratio")},
                "peak_rss_ratio": max(r["peak_rss_ratio"] for r in rows),
            }
        )
    )


if __name__ == "__main__":
    main()
