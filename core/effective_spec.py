"""A job's effective configuration, field by field, from the same spec model the API validates with: what the user
set, what the checkpoint it loads sets (read without torch, as admission reads it), what this engine builds whatever a
flag's Megatron default says (Qwen3: RMSNorm, RoPE, SwiGLU), else the model's default. The dashboard's Spec tab shows
it; a train job also records the checkpoint's values when it reads them (its ``config`` event)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic_core import to_jsonable_python

from core.models import Job
from engine.contract import inspect
from engine.contract.plan.shape import checkpoint_config
from engine.contract.runfiles import BadInput
from engine.contract.spec import SPEC_CLASSES, JobBase, ModelArgs

Source = Literal["set", "checkpoint", "checkpoint-unread", "engine", "default", "unset"]
# model-shape flags a loaded checkpoint decides when the spec leaves them unset
SHAPE_FIELDS = {*inspect.SHAPE_FLAGS, "group_query_attention", "num_query_groups", "max_position_embeddings"}


def _from_checkpoint(cls: type[JobBase], spec: dict[str, Any]) -> dict[str, Any] | None:
    """The flags the loaded checkpoint sets; None when the job loads none or it cannot be read now."""
    load = spec.get("load")
    if not isinstance(load, str) or not issubclass(cls, ModelArgs):
        return None
    try:
        cfg = checkpoint_config(load)
    except (BadInput, OSError):
        return None
    return inspect.checkpoint_flags(cfg, cls) if cfg is not None else None


def effective_fields(job: Job) -> list[dict[str, Any]]:
    """``[{field, value, source, description}]`` in the spec model's field order."""
    cls = SPEC_CLASSES.get(job.kind)
    if cls is None:
        return []
    spec = job.spec or {}
    read = _from_checkpoint(cls, spec)
    model = issubclass(cls, ModelArgs)
    rows = []
    for name, field in cls.model_fields.items():
        value: Any
        source: Source
        if name in spec:
            value, source = spec[name], "set"
        elif read is not None and name in read:
            value, source = read[name], "checkpoint"
        elif model and name in SHAPE_FIELDS and isinstance(spec.get("load"), str):
            value, source = None, "checkpoint-unread"
        elif model and name in inspect.QWEN3_FLAGS:
            value, source = inspect.QWEN3_FLAGS[name], "engine"
        else:
            value = field.get_default(call_default_factory=True)
            source = "unset" if value is None else "default"
        description = field.description or ""
        rows.append({"field": name, "value": to_jsonable_python(value), "source": source, "description": description})
    return rows
