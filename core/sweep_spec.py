"""What a sweep asks for: a base train spec, a search space over its fields, the metric to optimise and how to search
(Optuna's samplers and pruners). Checked at submission: a space naming an unknown field, or a base spec that does not
parse at the space's corners, is refused naming the field."""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core.errors import ApiError
from engine.contract.spec import TrainSpec, first_error, parse_spec

Scalar = bool | int | float | str
# Fields a trial may not vary: what makes it a trial of this sweep, where it runs, where it writes.
FIXED_FIELDS = {
    *("kind", "name", "metadata", "resources", "priority", "save"),
    *("report_to", "mlflow_tracking_uri", "mlflow_experiment", "mlflow_token_secret"),  # where every trial reports
}


class Dimension(BaseModel):
    """One searched field: ``choices`` (a list), or a range ``low``..``high`` (integers when both are), ``log`` to
    sample it on a log scale."""

    model_config = ConfigDict(extra="forbid")
    choices: list[Scalar] | None = Field(None, min_length=1, max_length=100)
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False

    @model_validator(mode="after")
    def _check(self) -> Dimension:
        ranged = self.low is not None or self.high is not None
        if (self.choices is None) == (not ranged):
            raise ValueError("give choices, or low and high")
        if ranged:
            if self.low is None or self.high is None or not self.low < self.high:
                raise ValueError("low and high: both, with low < high")
            if self.log and self.low <= 0:
                raise ValueError("low: must be > 0 on a log scale")
        return self

    @property
    def integer(self) -> bool:
        return isinstance(self.low, int) and isinstance(self.high, int)

    def corners(self) -> list[Scalar]:
        if self.choices is not None:
            return list(self.choices)
        assert self.low is not None and self.high is not None
        return [self.low, self.high]


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=120, pattern=r"^[\w.\-]+$")
    base: dict[str, Any] = Field(..., description="A train spec; each trial is it with the space's fields set.")
    space: dict[str, Dimension] = Field(..., min_length=1, max_length=20)
    metric: str = Field("val_lm_loss", min_length=1, max_length=128)
    direction: Literal["minimize", "maximize"] = "minimize"
    max_trials: int = Field(12, ge=1, le=1000)
    max_parallel: int = Field(2, ge=1, le=64)
    sampler: Literal["grid", "random", "tpe"] = "tpe"
    pruner: Literal["none", "median", "asha", "hyperband"] = "median"
    n_startup_trials: int = Field(3, ge=0, le=1000, description="median: trials that finish before any is pruned")
    n_warmup_steps: int = Field(0, ge=0, description="median: steps a trial runs before it can be pruned")
    min_resource: int = Field(1, ge=1, description="asha / hyperband: steps before the first rung")
    reduction_factor: int = Field(3, ge=2, le=10, description="asha / hyperband: 1/n of the trials go on at a rung")
    max_resource: int | None = Field(None, ge=1, description="hyperband: the most steps of a trial (its train_iters)")
    seed: int = Field(0, ge=0, le=2**31 - 1)

    @model_validator(mode="after")
    def _check(self) -> SweepSpec:
        if self.sampler == "grid":
            ranged = [k for k, d in self.space.items() if d.choices is None]
            if ranged:
                raise ValueError(f"space.{ranged[0]}: the grid sampler needs choices, not a range")
        if self.pruner == "hyperband" and self.max_resource is None:
            raise ValueError("max_resource: required with the hyperband pruner (a trial's train_iters)")
        return self

    def grid_size(self) -> int:
        return math.prod(len(d.choices or ()) for d in self.space.values())


def _field_error(err: ValidationError, prefix: str) -> ApiError:
    message = first_error(err, prefix or "sweep").removeprefix("sweep.")
    where = message.split(": ", 1)[0] if ": " in message else prefix or None
    return ApiError(422, "validation_error", message, where)


def parse_sweep(raw: Any, areas_context: dict[str, Any]) -> SweepSpec:
    """The sweep of a request body, its space's corners each parsed as a trial spec; 422 naming the field."""
    if not isinstance(raw, dict):
        raise ApiError(422, "validation_error", "the body must be a JSON object (a sweep)", None)
    try:
        sweep = SweepSpec.model_validate(raw)
    except ValidationError as err:
        raise _field_error(err, "") from None
    if sweep.base.get("kind", "train") != "train":
        raise ApiError(422, "validation_error", "base.kind: a sweep's trials are train jobs", "base.kind")
    for key in sweep.space:
        if key not in TrainSpec.model_fields or key in FIXED_FIELDS:
            raise ApiError(
                422, "validation_error", f"space.{key}: not a train spec field a trial may vary", f"space.{key}"
            )
    if sweep.sampler == "grid" and sweep.max_trials > sweep.grid_size():
        raise ApiError(422, "validation_error", f"max_trials: the grid has {sweep.grid_size()} points", "max_trials")
    names = list(sweep.space)
    corners = itertools.islice(itertools.product(*(sweep.space[k].corners() for k in names)), 64)
    for corner in corners:
        body = {**sweep.base, "kind": "train", **dict(zip(names, corner, strict=True))}
        try:
            parse_spec(body, **areas_context)
        except ValidationError as err:
            raise _field_error(err, "base") from None
    return sweep
