"""``python -m engine plan --suggest``: the layouts of a training job's world that fit its devices, best first.

Varies what trades memory for speed without changing the run's result: context parallelism (degree and algorithm),
tensor parallelism (with sequence parallelism) and recompute; the world size, PP, EP, micro-batch and sequence length
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


@dataclasses.dataclass(frozen=True)
class Candidate:
    cp: int
    algo: str | None  # None without CP
    tp: int
    recompute: str
    peak_bytes: int | None = None  # None: refused
    refused: str | None = None
    fits: bool = False

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rank(self) -> tuple[bool, int, int, int]:
        return (not self.fits, list(RECOMPUTE).index(self.recompute), self.cp * self.tp, self.peak_bytes or 0)


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def candidates(spec: TrainSpec, model: str | None, device_bytes: int) -> list[Candidate]:
    """Every CP × TP × recompute variant of ``spec`` over its own world, planned; ranked as the module says."""
    world = spec.resources.world_size
    base = spec.model_dump(mode="json", exclude_unset=True)
    found = []
    for cp in _powers_of_two(world):
        for tp in _powers_of_two(min(8, world // cp)):
            if world % (cp * tp * spec.pipeline_model_parallel_size):
                continue
            for algo in CP_ALGOS if cp > 1 else (None,):
                for name, flags in RECOMPUTE.items():
                    found.append(_plan(base, cp, algo, tp, name, flags, model, device_bytes))
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
) -> Candidate:
    layout = {
        "context_parallel_size": cp,
        "context_parallel_algo": algo or "ulysses_cp_algo",
        "tensor_model_parallel_size": tp,
        "sequence_parallel": tp > 1,
        **flags,
    }
    row = Candidate(cp, algo, tp, recompute)
    try:
        variant = TrainSpec.model_validate({**base, **layout})
        peak = plan_spec(variant, model).peak.total_bytes
    except ValidationError as err:
        return dataclasses.replace(row, refused=str(err.errors()[0]["msg"]).removeprefix("Value error, "))
    except ValueError as err:  # the planner's own refusals (a layout the model shape cannot take)
        return dataclasses.replace(row, refused=str(err))
    return dataclasses.replace(row, peak_bytes=peak, fits=peak <= device_bytes)


def suggestion_table(found: list[Candidate], device_bytes: int, top: int = 10) -> str:
    """The ``top`` fitting candidates, best first (or a line saying none fits)."""
    fitting = [c for c in found if c.fits][:top]
    if not fitting:
        return f"no CP × TP × recompute layout of this world fits {device_bytes / 2**30:.2f} GiB per device"
    lines = [f"layouts that fit {device_bytes / 2**30:.2f} GiB per device, best first:"]
    lines.append(f"{'CP':>3} {'algorithm':<17} {'TP':>3} {'recompute':<10} {'peak GiB':>9}")
    for c in fitting:
        gib = (c.peak_bytes or 0) / 2**30
        lines.append(f"{c.cp:>3} {c.algo or '-':<17} {c.tp:>3} {c.recompute:<10} {gib:>9.2f}")
    return "\n".join(lines)
