"""Per-iteration metrics: metrics.jsonl, TensorBoard and Megatron's human log line, written by global rank 0.

Step results arrive as device tensors (loss sum, grad norm) and are turned into numbers only every ``log_interval``
iterations, in one batch (a single host sync), so logging never stalls the device between steps. Per-rank memory is
gathered with one small all-gather at the same moment. The log line copies Megatron/MindSpeed's (seed 004)::

    [2026-01-06 14:11:44] iteration 1/ 390 | consumed samples: 128 | elapsed time per iteration (ms): 9116.1 |
    learning rate: 1.247115E-06 | global batch size: 128 | lm loss: 3.889437E+00 | loss scale: 1.0 |
    grad norm: 191.792 | number of skipped iterations: 0 | number of nan iterations: 0 |

followed after the first iteration by ``[Rank R] (after 1 iterations) memory (MB) | allocated: ... |`` per rank.
Validation (``validation``) is reported as Megatron reports it::

    validation loss at iteration 100 | lm loss value: 2.345678E+00 | lm loss PPL: 1.044017E+01 |
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import RunDir
from engine.parallel.device import Device, flops_per_token
from engine.train.router_stats import router_summary

log = logging.getLogger("engine.train")

PER = "#per"  # a stat named ``x#per`` is the count ``x`` is reported per (``reported_stats``)


def reported_stats(sums: dict[str, float], units: float) -> dict[str, float]:
    """Summed stats as reported: ``x`` over ``x#per`` where a stat has its own count (TRL's logits means over labelled
    positions and the vocabulary), else over ``units`` (pairs: the preference figures are per-pair sums)."""
    out = {}
    for name, value in sums.items():
        if name.endswith(PER):
            continue
        per = sums.get(name + PER, units)
        out[name] = value / per if per else float("nan")
    return out


@dataclasses.dataclass
class StepRecord:
    """What one iteration produced; tensors stay on the device until ``MetricsLogger.flush``."""

    iteration: int
    loss_sum: torch.Tensor  # global (all-reduced) sum of token losses
    counts: torch.Tensor  # global [labelled tokens, real (non-padding) tokens, sum of L_i^2 over samples]
    grad_norm: torch.Tensor
    skipped: bool
    lr: float
    loss_scale: float
    elapsed_s: float
    consumed_samples: int
    extra_losses: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # named terms (global sums)
    router: torch.Tensor | None = None  # MoE: ``RouterTracker.step_figures`` (global sums per MoE layer)
    stats: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # global sums, reported per loss unit


class MetricsLogger:
    def __init__(
        self,
        run: RunDir,
        cfg: ModelConfig,
        device: Device,
        train_iters: int,
        global_batch_size: int,
        log_interval: int,
        tensorboard_dir: str | None,
        lora: bool,
        moe_layers: list[int] | None = None,
    ):
        self.run, self.cfg, self.device = run, cfg, device
        self.moe_layers = moe_layers or []
        self.train_iters, self.gbs, self.log_interval = train_iters, global_batch_size, log_interval
        self.lora = lora
        self.world = dist.get_world_size()
        self.peak = device.peak_tflops()
        self.pending: list[StepRecord] = []
        self.totals = {"skipped_iterations": 0, "nan_iterations": 0}
        self.last: dict[str, Any] = {}
        self.last_validation: dict[str, Any] = {}
        self.tokens_per_s: list[float] = []
        self.memory_reported = False
        self.tb = None
        if tensorboard_dir and run.is_writer:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard_dir)

    def record(self, rec: StepRecord) -> None:
        self.pending.append(rec)
        if rec.iteration % self.log_interval == 0 or rec.iteration == self.train_iters:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        recs, self.pending = self.pending, []
        # One host sync for the whole interval.
        parts = [
            torch.cat(
                [
                    r.loss_sum.double()[None],
                    r.counts.double(),
                    r.grad_norm.double()[None],
                    *(r.extra_losses[k].double()[None] for k in sorted(r.extra_losses)),
                    *(r.stats[k].double()[None] for k in sorted(r.stats)),
                    *([] if r.router is None else [r.router.double().flatten()]),
                ]
            )
            for r in recs
        ]
        flat = torch.cat(parts).cpu().tolist()
        numbers = []
        for part in parts:
            numbers.append(flat[: len(part)])
            flat = flat[len(part) :]
        memory = self._gather_memory()
        rows = []
        for r, n in zip(recs, numbers, strict=True):
            extra = 5 + len(r.extra_losses)
            row = {**self._metrics(r, *n[:5]), **dict(zip(sorted(r.extra_losses), n[5:extra], strict=True))}
            row.update(reported_stats(dict(zip(sorted(r.stats), n[extra : extra + len(r.stats)], strict=True)), n[1]))
            extra += len(r.stats)
            if r.router is not None:
                width = r.router.shape[1]
                row.update(router_summary(self.moe_layers, [n[i : i + width] for i in range(extra, len(n), width)]))
            rows.append(row)
        for rec, row in zip(recs, rows, strict=True):
            self.run.metric(rec.iteration, row, rank_metrics=memory)
            self._tensorboard(rec, row)
        self.last = rows[-1]
        if self.run.is_writer:
            log.info("%s", self.log_line(recs, rows))
        if not self.memory_reported:
            self.memory_reported = True
            log.info("%s", self.memory_line(recs[-1].iteration))

    def _metrics(
        self,
        rec: StepRecord,
        loss_sum: float,
        loss_tokens: float,
        real_tokens: float,
        sum_sq_len: float,
        grad_norm: float,
    ) -> dict[str, Any]:
        loss = loss_sum / loss_tokens if loss_tokens else float("nan")
        nan = not math.isfinite(loss)
        self.totals["skipped_iterations"] += int(rec.skipped)
        self.totals["nan_iterations"] += int(nan)
        seconds = max(rec.elapsed_s, 1e-9)
        tokens_per_s = real_tokens / seconds
        self.tokens_per_s.append(tokens_per_s)
        mean_len = sum_sq_len / max(real_tokens, 1)  # attention term of packed samples: sum L^2 / sum L
        flops = flops_per_token(self.cfg, round(mean_len), causal=False, lora=self.lora) * real_tokens
        tflops = flops / seconds / self.world / 1e12
        return {
            "iteration": rec.iteration,
            "consumed_samples": rec.consumed_samples,
            "lm_loss": loss,
            "lr": rec.lr,
            "grad_norm": None if rec.skipped else grad_norm,
            "loss_scale": rec.loss_scale,
            "skipped_iterations": int(rec.skipped),
            "nan_iterations": int(nan),
            "iteration_time_ms": seconds * 1000.0,
            "tokens": int(real_tokens),
            "loss_tokens": int(loss_tokens),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world,
            "tflops": tflops,
            "mfu": None if self.peak is None else tflops / self.peak,
            "global_batch_size": self.gbs,
        }

    def _gather_memory(self) -> dict[int, dict[str, float]]:
        stats = self.device.memory_stats()
        names = sorted(stats)
        mine = torch.tensor([stats[n] for n in names], dtype=torch.float64, device=self.device.torch_device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        return {r: dict(zip(names, t.cpu().tolist(), strict=True)) for r, t in enumerate(every)}

    def _tensorboard(self, rec: StepRecord, row: dict[str, Any]) -> None:
        if self.tb is None:
            return
        # Megatron's TensorBoard tags, plus our throughput figures.
        tags = {
            "lm loss": "lm_loss",
            "load_balancing_loss": "load_balancing_loss",
            "learning-rate": "lr",
            "grad-norm": "grad_norm",
            "loss-scale": "loss_scale",
            "iteration-time": "iteration_time_ms",
            "tokens-per-second": "tokens_per_s",
            "tflops": "tflops",
        }
        for tag, key in tags.items():
            if isinstance(row.get(key), (int, float)) and math.isfinite(row[key]):
                self.tb.add_scalar(tag, row[key], rec.iteration)
        if math.isfinite(row["lm_loss"]):
            self.tb.add_scalar("lm loss vs samples", row["lm_loss"], rec.consumed_samples)

    def log_line(self, recs: list[StepRecord], rows: list[dict[str, Any]]) -> str:
        """Megatron's line for the interval: time and loss averaged over it, the rest from its last iteration."""
        last, row = recs[-1], rows[-1]
        finite = [r["lm_loss"] for r in rows if math.isfinite(r["lm_loss"])]
        loss = sum(finite) / len(finite) if finite else float("nan")
        ms = sum(r["iteration_time_ms"] for r in rows) / len(rows)
        norm = next((r["grad_norm"] for r in reversed(rows) if r["grad_norm"] is not None), float("nan"))
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        return (
            f"[{stamp}] iteration {last.iteration}/ {self.train_iters} | consumed samples: {last.consumed_samples} | "
            f"elapsed time per iteration (ms): {ms:.1f} | learning rate: {row['lr']:.6E} | "
            f"global batch size: {self.gbs} | lm loss: {loss:.6E} | loss scale: {row['loss_scale']:.1f} | "
            f"grad norm: {norm:.3f} | number of skipped iterations: {sum(r['skipped_iterations'] for r in rows)} | "
            f"number of nan iterations: {sum(r['nan_iterations'] for r in rows)} |"
        )

    def memory_line(self, iteration: int) -> str:
        """This rank's memory report (every rank logs its own, into its own log file)."""
        s = self.device.memory_stats()
        return (
            f"[Rank {dist.get_rank()}] (after {iteration} iterations) memory (MB) | allocated: {s['mem_allocated_mb']} | "
            f"max allocated: {s['mem_max_allocated_mb']} | reserved: {s['mem_reserved_mb']} | "
            f"max reserved: {s['mem_reserved_mb']}"
        )

    def validation(
        self, iteration: int, loss_sum: float, tokens: float, seconds: float, stats: dict[str, float] | None = None
    ) -> dict[str, Any]:
        """Record one validation pass: the summed loss over ``tokens`` loss units of the validation share (labelled
        tokens; pairs for stage dpo, whose summed ``stats`` are reported per pair as ``val_<name>``, TRL's
        ``rewards/...`` and ``logps/...`` on held-out pairs)."""
        self.flush()  # training points first, so the streams stay in step order
        loss = loss_sum / tokens if tokens else float("nan")
        ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")  # Megatron caps the exponent at 20
        row = {"val_lm_loss": loss, "val_lm_ppl": ppl, "val_loss_tokens": int(tokens), "val_time_s": seconds}
        row.update({f"val_{name}": value for name, value in reported_stats(stats or {}, tokens).items()})
        self.run.metric(iteration, row)
        self.last_validation = row
        if self.tb is not None and math.isfinite(loss):
            self.tb.add_scalar("lm loss validation", loss, iteration)  # Megatron's tags
            self.tb.add_scalar("lm loss validation ppl", ppl, iteration)
        if self.run.is_writer:
            bar = "-" * 100
            log.info(
                "%s\n validation loss at iteration %d | lm loss value: %.6E | lm loss PPL: %.6E | \n%s",
                bar,
                iteration,
                loss,
                ppl,
                bar,
            )
        return row

    def close(self) -> None:
        self.flush()
        if self.tb is not None:
            self.tb.close()

    def summary(self) -> dict[str, Any]:
        steady = self.tokens_per_s[1:] or self.tokens_per_s  # the first iteration includes warm-up
        return {
            **self.totals,
            "final_lm_loss": self.last.get("lm_loss"),
            "final_grad_norm": self.last.get("grad_norm"),
            "final_val_lm_loss": self.last_validation.get("val_lm_loss"),
            "mean_tokens_per_s": sum(steady) / len(steady) if steady else None,
        }
