"""Typed reads of a stored job's spec (``Job.spec``: the JSON of the spec parsed and admitted at submission).

The service reads a handful of fields after submission (resources, deadlines, a serve job's names, a train job's
length); they are read here and only here, typed, rather than as ``job.spec["..."]`` in each module. The spec is
not re-parsed as a whole: a job stored under an older schema stays readable for what the service needs of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.contract.spec import Resources


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


@dataclasses.dataclass(frozen=True)
class StoredSpec:
    raw: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return str(self.raw.get("kind") or "")

    @property
    def resources(self) -> Resources:
        return Resources.model_validate(self.raw.get("resources") or {})

    @property
    def run_deadline_s(self) -> float | None:
        return _number(self.raw.get("run_deadline_s"))

    @property
    def train_iters(self) -> int | None:
        return _int(self.raw.get("train_iters"))

    @property
    def load(self) -> str | None:
        return _str(self.raw.get("load"))

    @property
    def save(self) -> str | None:
        return _str(self.raw.get("save"))

    @property
    def served_model_name(self) -> str | None:
        return _str(self.raw.get("served_model_name"))

    @property
    def lora_adapters(self) -> dict[str, str]:
        adapters = self.raw.get("lora_adapters")
        return {str(k): str(v) for k, v in adapters.items()} if isinstance(adapters, Mapping) else {}

    @property
    def deployment(self) -> str | None:
        return _str(self.raw.get("deployment"))


def stored_spec(spec: Mapping[str, Any] | None) -> StoredSpec:
    """The typed view of a stored spec (``job.spec``; None reads as an empty one)."""
    return StoredSpec(spec or {})
