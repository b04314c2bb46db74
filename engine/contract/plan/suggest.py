"""``python -m engine plan --suggest``: the layouts of a training job's world that fit its devices, best first.

Varies what trades memory for speed without changing the run's result: context parallelism (degree and algorithm),
tensor parallelism (with sequence parallelism) and recompute; then, for a bf16 run, Megatron's precision-aware
optimizer storage (bf16 moments, bf16 main grads, the state offloaded to the host), which changes the numerics
slightly and so is only proposed when no layout fits without it; the world size, PP, EP, micro-batch and sequence length
stay as the spec has them. Each candidate is the spec re-validated with those fields changed (a layout the model's
heads or the world cannot take is dropped with the validator's reason) and planned like any submission. Ranking:
fitting candidates first, then the cheapest recompute, then the fewest ranks per sequence (TP × CP: less
communication), then the lowest peak — the layout a user would try first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import ValidationError

from engine.contract.plan.planner import plan_spec
from engine.contract.spec import TrainSpec

RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None},
    "selective": {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}
CP_ALGOS = ("ulysses_cp_algo", "megatron_cp_algo")
# The optimizer's storage, least change first: the spec's own, then Megatron's precision-aware options (bf16 moments;
# with bf16 main grads; the state offloaded to the host). They change the numerics slightly, so they rank after
# every layout that fits without them.
_AWARE = {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
OPTIMIZER: dict[str, dict[str, Any]] = {
    "as given": {},
    "bf16 moments": _AWARE,
    "bf16 grads+moments": {**_AWARE, "main_grads_dtype": "bf16"},
    "offload 1.0": {**_AWARE, "optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0},
}


@dataclasses.dataclass(frozen=True)
class Candidate:
    cp: int
    algo: str | None  # None without CP
    tp: int
    recompute: str
    optimizer: str = "as given"
    peak_bytes: int | None = None  # None: refused
    host_bytes: int = 0  # the worst rank's host memory (offloaded optimizer state)
    refused: str | None = None
    fits: bool = False

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rank(self) -> tuple[bool, int, int, int, int]:
        recompute = list(RECOMPUTE).index(self.recompute)
        return (
            not self.fits,
            list(OPTIMIZER).index(self.optimizer),
            recompute,
            self.cp * self.tp,
            self.peak_bytes or 0,
        )


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def candidates(spec: TrainSpec, model: str | None, device_bytes: int) -> list[Candidate]:
    """Every CP × TP × recompute × optimizer-storage variant of ``spec`` over its own world, planned; ranked as the
    module says (the optimizer options only where the spec is not precision-aware already and bf16)."""
    world = spec.resources.world_size
    base = spec.model_dump(mode="json", exclude_unset=True)
    found: list[Candidate] = []
    for label in optimizer_options(spec):
        if any(c.fits for c in found):  # the optimizer's storage is only changed when no layout fits without it
            break
        for cp in _powers_of_two(world):
            for tp in _powers_of_two(min(8, world // cp)):
                if world % (cp * tp * spec.pipeline_model_parallel_size):
                    continue
                for algo in CP_ALGOS if cp > 1 else (None,):
                    for name, flags in RECOMPUTE.items():
                        both = {**flags, **OPTIMIZER[label]}
                        found.append(_plan(base, cp, algo, tp, name, both, model, device_bytes, label))
    return sorted(found, key=Candidate.rank)


def _plan(
    base: dict[str, Any],
    cp: int,
    algo: str | None,
    tp: int,
    recompute: str,
    flags: dict[str, Any],
    model: str | None,
    device_bytes: int,
    optimizer: str = "as given",
) -> Candidate:
    layout = {
        "context_parallel_size": cp,
        "context_parallel_algo": algo or "ulysses_cp_algo",
        "tensor_model_parallel_size": tp,
        "sequence_parallel": tp > 1,
        **flags,
    }
    row = Candidate(cp, algo, tp, recompute, optimizer)
    try:
        variant = TrainSpec.model_validate({**base, **layout})
        worst = plan_spec(variant, model).peak
        peak = worst.total_bytes
        row = dataclasses.replace(row, host_bytes=worst.host)
    except ValidationError as err:
        return dataclasses.replace(row, refused=str(err.errors()[0]["msg"]).removeprefix("Value error, "))
    except ValueError as err:  # the planner's own refusals (a layout the model shape cannot take)
        return dataclasses.replace(row, refused=str(err))
    return dataclasses.replace(row, peak_bytes=peak, fits=peak <= device_bytes)


def optimizer_options(spec: TrainSpec) -> list[str]:
    """The optimizer variants worth planning: the spec's own, plus the precision-aware ones for a bf16 run that does
    not use them yet."""
    if spec.use_precision_aware_optimizer or not spec.bf16 or spec.is_lora:
        return ["as given"]
    return list(OPTIMIZER)


def suggestion_table(found: list[Candidate], device_bytes: int, top: int = 10) -> str:
    """The ``top`` fitting candidates, best first (or a line saying none fits)."""
    fitting = [c for c in found if c.fits][:top]
    if not fitting:
        return f"no CP × TP × recompute layout of this world fits {device_bytes / 2**30:.2f} GiB per device"
    lines = [f"layouts that fit {device_bytes / 2**30:.2f} GiB per device, best first:"]
    lines.append(
        f"{'CP':>3} {'algorithm':<17} {'TP':>3} {'recompute':<10} {'optimizer':<18} {'peak GiB':>9} {'host GiB':>9}"
    )
    for c in fitting:
        gib, host = (c.peak_bytes or 0) / 2**30, c.host_bytes / 2**30
        lines.append(
            f"{c.cp:>3} {c.algo or '-':<17} {c.tp:>3} {c.recompute:<10} {c.optimizer:<18} {gib:>9.2f} {host:>9.2f}"
        )
    return "\n".join(lines)
