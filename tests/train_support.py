"""Shared helpers of the train tests (not a test module): tiny instruction datasets and tiny train specs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from engine.contract.indexed import PAIRWISE_FIELDS, IndexedDatasetWriter, instruction_prefix

# Qwen3-4B as the seed scripts give it (MindSpeed flag names): the planner tests size the seed lines with it.
QWEN3_4B: dict[str, Any] = {
    "num_layers": 36,
    "hidden_size": 2560,
    "ffn_hidden_size": 9728,
    "num_attention_heads": 32,
    "group_query_attention": True,
    "num_query_groups": 8,
    "kv_channels": 128,
    "padded_vocab_size": 151936,
}

TINY_SHAPE: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "group_query_attention": True,
    "num_query_groups": 2,
    "kv_channels": 16,
    "padded_vocab_size": 512,
}


def write_instruction_data(prefix: Path, n: int = 48, vocab: int = 512, seed: int = 0) -> str:
    """``n`` samples of 8-39 tokens; the answer is one of 8 tokens (chosen by the first prompt token), repeated, so
    the loss falls within a few iterations."""
    rng = np.random.default_rng(seed)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    writers = {
        f: IndexedDatasetWriter(instruction_prefix(prefix, f)) for f in ("input_ids", "attention_mask", "labels")
    }
    for _ in range(n):
        length = int(rng.integers(8, 40))
        ids = rng.integers(1, vocab, length)
        answer = int(rng.integers(4, length - 2))
        ids[answer:] = ids[0] % 8 + 1
        labels = ids.copy()
        labels[:answer] = -100
        writers["input_ids"].add_document(ids)
        writers["attention_mask"].add_document(np.ones(length))
        writers["labels"].add_document(labels)
    for w in writers.values():
        w.finalize()
    return str(prefix)


def write_pairwise_data(prefix: Path, n: int = 16, vocab: int = 512, seed: int = 0) -> str:
    """``n`` preference pairs in MindSpeed's pairwise layout: a shared prompt of 4-11 tokens, then a chosen answer
    (one token repeated, picked by the first prompt token) and a rejected one (random tokens) of 3-14 tokens."""
    rng = np.random.default_rng(seed)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    writers = {f: IndexedDatasetWriter(instruction_prefix(prefix, f)) for f in PAIRWISE_FIELDS}
    for _ in range(n):
        prompt = rng.integers(1, vocab, int(rng.integers(4, 12)))
        answers = {
            "chosen": np.full(int(rng.integers(3, 15)), prompt[0] % 8 + 1),
            "rejected": rng.integers(1, vocab, int(rng.integers(3, 15))),
        }
        for side, answer in answers.items():
            ids = np.concatenate([prompt, answer])
            labels = ids.copy()
            labels[: prompt.size] = -100
            writers[f"{side}_input_ids"].add_document(ids)
            writers[f"{side}_labels"].add_document(labels)
    for w in writers.values():
        w.finalize()
    return str(prefix)


def tiny_spec(data: str, **overrides: Any) -> dict[str, Any]:
    spec = {
        "kind": "train",
        "data_path": [data],
        "split": "100,0,0",
        "train_iters": 4,
        "lr": 1e-2,
        "min_lr": 0.0,
        "lr_warmup_iters": 1,
        "seq_length": 64,
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "log_interval": 1,
        "seed": 7,
        **TINY_SHAPE,
    }
    spec.update(overrides)
    return spec


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_train(spec: dict[str, Any], run_dir: Path, nproc: int, expect_rc: int = 0) -> subprocess.CompletedProcess:
    """``python -m engine train`` on ``spec`` in a fresh process (under torchrun when ``nproc`` > 1), which must exit
    with ``expect_rc``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    launcher = (
        [sys.executable, "-m", "engine"]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "engine",
        ]
    )
    proc = subprocess.run(
        [*launcher, "train", "--spec", str(run_dir / "spec.json"), "--run-dir", str(run_dir)],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == expect_rc, proc.stderr[-4000:]
    return proc


def train_in_process(spec: dict[str, Any], run_dir: Path) -> list[dict[str, Any]]:
    """The metric rows of ``spec`` trained in this process (the runner ``python -m engine train`` calls, without a
    fresh interpreter's ~20 s of imports), on one intra-op thread like ``run_train``'s OMP_NUM_THREADS=1, so that
    its arithmetic is a one-process run's."""
    import torch

    from engine.contract.runfiles import RunDir
    from engine.contract.spec import parse_spec
    from engine.train import entry

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        entry.run(parse_spec(spec), RunDir(run_dir))
    finally:
        torch.set_num_threads(threads)
    return metric_rows(run_dir)


_ONE_PROCESS_ROWS: dict[str, list[dict[str, Any]]] = {}


def one_process_rows(spec: dict[str, Any], run_dir: Path) -> list[dict[str, Any]]:
    """The metric rows of ``spec`` trained on one process (this one: ``train_in_process``). The layout tests compare
    many layouts against the same one-process run: an equal spec (data path included) runs once per test process and
    is read from memory after."""
    key = json.dumps(spec, sort_keys=True)
    if key not in _ONE_PROCESS_ROWS:
        _ONE_PROCESS_ROWS[key] = train_in_process(spec, run_dir)
    return [dict(row) for row in _ONE_PROCESS_ROWS[key]]
