"""Start-up benchmark: a Qwen3-4B-shaped bf16 HF checkpoint loaded for a LoRA run with PP2 on two CPU processes.

The checkpoint (random values, written tensor by tensor through ``engine.checkpoint.hf.save_hf``, never whole in
memory) is generated once under ``--work-dir`` and its pages are dropped from the page cache before the run. The run
is ``engine.train.measure`` under torchrun (2 ranks): a LoRA fine-tune (r 16, bf16, distributed optimizer, MBS 1,
GBS 2, short sequences), one iteration. Per rank:

- ``startup_rss_ratio``: (peak RSS - the rank's RSS before the job, i.e. interpreter + torch + process group) / the
  rank's bf16 shard (its base parameters × 2 B, counted by ``engine.contract.plan``: embedding on the first stage, final norm
  and the (tied copy of the) head on the last). Target <= 1.3. The fixed cost is reported apart (``fixed_rss_mib``).
- ``read_ratio``: bytes the rank read / its shard. ``rchar`` (bytes through read syscalls, page cache or not), since
  the checkpoint readers use ``pread``; ``read_bytes`` (from storage) is reported too but undercounts what a rank
  reads after the other rank brought the same pages into the cache. Target <= 1.1.
- ``first_iteration_s``: from launching torchrun to the first metrics line (the end of iteration 1); with
  ``--built-only`` the run stops once both ranks have built and loaded their parts and ``loaded_s`` is reported
  instead (a real-size bf16 iteration needs a CPU with bf16 instructions: without AVX-512 torch's bf16 GEMM runs at
  ~0.1 GFLOP/s, hours for one 4B-shaped step).

``--layers`` shrinks the model (the shape of each layer, vocabulary and embedding stay Qwen3-4B's) when the host
cannot hold today's per-rank peak.

    .venv/bin/python bench/startup.py [--work-dir /tmp/llmjobs-bench-startup] [--layers 36] [--seq 64] [--built-only]

Last line: {"bench":"startup","startup_rss_ratio":...,"read_ratio":...,"first_iteration_s":...,...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.contract.model_config import ModelConfig, preset
from engine.contract.plan import plan_spec
from engine.contract.spec import parse_spec

MIB = 2**20


def generate(path: Path, cfg: ModelConfig) -> Path:
    """Write ``cfg``'s model as a bf16 HF directory, one random tensor at a time; kept for later runs."""
    config = path / "config.json"
    if config.is_file() and ModelConfig.from_hf(json.loads(config.read_text())) == cfg:
        return path
    import torch

    from engine.checkpoint.hf import save_hf
    from engine.checkpoint.layout import native_shapes

    shapes = native_shapes(cfg)
    gen = torch.Generator().manual_seed(0)

    def get(key: str) -> torch.Tensor:
        shape = shapes[key]
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)

    save_hf(get, cfg, path, dtype=torch.bfloat16)
    return path


def drop_page_cache(path: Path) -> None:
    """Evict the checkpoint's pages so reads in the run come from storage (``read_bytes`` then means something)."""
    for file in path.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_data(prefix: Path, seq: int, vocab: int, n: int = 16) -> str:
    import numpy as np

    from engine.contract.indexed import IndexedDatasetWriter, instruction_prefix

    rng = np.random.default_rng(0)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    fields = ("input_ids", "attention_mask", "labels")
    writers = {f: IndexedDatasetWriter(instruction_prefix(prefix, f)) for f in fields}
    for _ in range(n):
        ids = rng.integers(1, vocab, seq)
        labels = ids.copy()
        labels[: seq // 4] = -100
        writers["input_ids"].add_document(ids)
        writers["attention_mask"].add_document(np.ones(seq))
        writers["labels"].add_document(labels)
    for w in writers.values():
        w.finalize()
    return str(prefix)


def lora_spec(ckpt: Path, data: str, save: Path, seq: int) -> dict[str, Any]:
    return {
        "kind": "train",
        "load": str(ckpt),
        "data_path": [data],
        "split": "100,0,0",
        "train_iters": 1,
        "lr": 1e-4,
        "seq_length": seq,
        "micro_batch_size": 1,
        "global_batch_size": 2,
        "pipeline_model_parallel_size": 2,
        "bf16": True,
        "use_distributed_optimizer": True,
        "lora_r": 16,
        "lora_alpha": 32,
        "finetune": True,
        "eval_iters": 0,
        "log_interval": 1,
        "save": str(save),
        "seed": 1,
        "resources": {"device_type": "cpu", "nnodes": 1, "nproc_per_node": 2},
    }


def run(spec: dict[str, Any], run_dir: Path, built_only: bool) -> tuple[list[dict[str, Any]], float, float]:
    """(per-rank measurements, seconds to the first iteration (or to the loaded model), total seconds) of one
    torchrun of ``spec``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "engine.train.measure",
        str(run_dir / "spec.json"),
        str(run_dir),
        *(["built"] if built_only else []),
    ]
    started = time.time()
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    total = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    marker = (run_dir / "built.json").read_text() if built_only else (run_dir / "metrics.jsonl").read_text()
    first = json.loads(marker.splitlines()[0])["time"]
    ranks = [json.loads((run_dir / f"measure_rank{r}.json").read_text()) for r in range(2)]
    return ranks, first - started, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="/tmp/llmjobs-bench-startup")
    parser.add_argument("--layers", type=int, default=36, help="decoder layers (Qwen3-4B has 36); even, for PP2")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--built-only", action="store_true", help="stop once the model is built and loaded")
    parser.add_argument("--smoke", action="store_true", help="the qwen3-tiny shape, seq 16: the same code path")
    args = parser.parse_args()
    work = Path(args.work_dir)
    base = "qwen3-tiny" if args.smoke else "qwen3-4b"
    if args.smoke:
        args.layers, args.seq = preset(base).num_layers, 16
    cfg = preset(base).replace(num_layers=args.layers)
    ckpt = generate(work / f"{base}-{args.layers}l", cfg)
    drop_page_cache(ckpt)
    data = write_data(work / "data" / "d", args.seq, cfg.vocab_size)
    spec = lora_spec(ckpt, data, work / "save", args.seq)
    shards = [(r.num_params - r.trainable_params) * 2 for r in plan_spec(parse_spec(spec)).ranks]
    ranks, first_s, total_s = run(spec, work / f"run-{int(time.time())}", args.built_only)
    rows = []
    for r, (m, shard) in enumerate(zip(ranks, shards)):
        reads = m["rchar"]
        row = {
            "rank": r,
            "shard_mib": round(shard / MIB, 1),
            "fixed_rss_mib": round(m["baseline_bytes"] / MIB, 1),
            "peak_rss_mib": round(m["peak_bytes"] / MIB, 1),
            "growth_mib": round(m["growth_bytes"] / MIB, 1),
            "startup_rss_ratio": round(m["growth_bytes"] / shard, 3),
            "rchar_mib": round(reads / MIB, 1),
            "read_bytes_mib": round(m["read_bytes"] / MIB, 1),
            "read_ratio": round(reads / shard, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        json.dumps(
            {
                "bench": "startup",
                "smoke": args.smoke,
                "layers": args.layers,
                "seq": args.seq,
                "startup_rss_ratio": max(r["startup_rss_ratio"] for r in rows),
                "read_ratio": max(r["read_ratio"] for r in rows),
                "fixed_rss_mib": max(r["fixed_rss_mib"] for r in rows),
                ("loaded_s" if args.built_only else "first_iteration_s"): round(first_s, 1),
                "total_s": round(total_s, 1),
                "targets": {"startup_rss_ratio": 1.3, "read_ratio": 1.1},
            }
        )
    )


if __name__ == "__main__":
    main()
