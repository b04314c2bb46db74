"""Which periodic training checkpoints a run keeps (``keep_last_n``, ``keep_best_by``): one pure rule, no I/O.

Kept: the checkpoint just written, the ``keep_last_n - 1`` complete ones before it and, with ``keep_best_by``, the
one with the lowest value of that metric (a loss: lower is better; ties go to the newer) among those that have a
finite value. Checkpoints newer than the one just written are never touched (they are not this timeline's), and
neither is anything when ``keep_last_n`` is unset. ``engine.checkpoint.dcp.prune`` applies it on disk.
Torch-free, so the spec layer and tests use it cheaply.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# keep_best_by spellings users write (MindSpeed's log says "lm loss", validation "val loss") -> the metric name
METRIC_ALIASES = {
    "loss": "lm_loss",
    "val_loss": "val_lm_loss",
    "validation_loss": "val_lm_loss",
    "valid_loss": "val_lm_loss",
    "lm_loss_validation": "val_lm_loss",
}
BEST_BY_METRICS = ("lm_loss", "val_lm_loss")


def metric_name(value: object) -> object:
    """``"lm loss"``, ``"LM-Loss"``, ``"val_loss"`` -> the metric name (``lm_loss``, ``val_lm_loss``); others as given."""
    if not isinstance(value, str):
        return value
    key = "_".join(value.strip().lower().replace("-", " ").split())
    return METRIC_ALIASES.get(key, key)


def to_delete(
    saved: Mapping[int, float | None], just_saved: int, keep_last_n: int | None, keep_best: bool = False
) -> list[int]:
    """Iterations (ascending) to delete after ``just_saved`` was written completely.

    ``saved`` maps every complete checkpoint's iteration (``just_saved`` included) to its ``keep_best_by`` value,
    None when it has none or none is asked."""
    if keep_last_n is None:
        return []
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n must be >= 1, got {keep_last_n}")
    older = sorted(i for i in saved if i < just_saved)
    keep = {just_saved, *older[max(len(older) - (keep_last_n - 1), 0) :]}
    if keep_best:
        scored = [
            (value, -i) for i in (*older, just_saved) if (value := saved.get(i)) is not None and math.isfinite(value)
        ]
        if scored:
            keep.add(-min(scored)[1])
    return [i for i in older if i not in keep]
