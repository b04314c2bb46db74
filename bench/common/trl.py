"""The TRL training benchmarks' matched settings (a helper of ``bench/``, not a benchmark): our train spec's and TRL's
trainer arguments for the same run, side by side so they cannot drift apart, and a clock on each TRL optimizer step.
Imports ``transformers``: import it inside a side's process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback


def matched_spec(steps: int) -> dict[str, Any]:
    """Our train spec's side of ``matched_args``: ``steps`` iterations at a constant lr 1e-6, no weight decay, clip
    1.0, rows as long as their sample (up to 1,024 tokens), a metrics line each iteration."""
    return {
        "kind": "train",
        "split": "100,0,0",
        "train_iters": steps,
        "lr": 1e-6,
        "lr_decay_style": "constant",
        "weight_decay": 0.0,
        "clip_grad": 1.0,
        "seq_length": 1024,
        "variable_seq_lengths": True,
        "log_interval": 1,
    }


def matched_args(work: Path, steps: int) -> dict[str, Any]:
    """``TrainingArguments`` doing what the benches' specs do: ``steps`` steps at a constant lr 1e-6, no weight decay,
    gradients clipped at 1.0, fp32 on CPU (TRL defaults to bf16 autocast, on CPU too), a log line a step, nothing
    saved or reported."""
    return {
        "output_dir": str(work / "trl"),
        "max_steps": steps,
        "learning_rate": 1e-6,
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "bf16": False,
        "seed": 0,
    }


class StepClock(TrainerCallback):
    """Each optimizer step's wall time (s), from the trainer's step callbacks."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.started = 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter() - self.started)


def start_side(threads: int) -> float:
    """A side's fresh process before it runs: both stacks imported (neither side pays for the other's imports), its
    intra-op threads set; returns its RSS (MiB), the base of its peak memory."""
    import torch
    import trl  # noqa: F401

    from bench.common.memory import rss_mb

    torch.set_num_threads(threads)
    return rss_mb()
