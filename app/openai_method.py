"""OpenAI's fine-tuning ``method`` on a train spec, mapped onto this service's fields before validation.

Tools written against OpenAI's fine-tuning API send ``{"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta":
0.1}}}}`` (or ``"supervised"``). On a ``train`` body this becomes MindSpeed's fields: ``stage`` (``dpo`` with
``is_pairwise_dataset``; ``supervised`` is the default training), ``dpo_beta`` from ``beta``, ``global_batch_size`` from ``batch_size``. OpenAI's
``"auto"`` leaves our default. ``n_epochs`` and ``learning_rate_multiplier`` have no meaning here (``train_iters``
and ``lr`` are absolute): a number is refused, naming the field to set instead. A field set both ways must agree.
"""

from __future__ import annotations

from typing import Any

from core.errors import ApiError

METHODS = ("supervised", "dpo")
_TAKEN = {"beta": "dpo_beta", "batch_size": "global_batch_size"}  # OpenAI hyperparameter -> spec field
_REFUSED = {"n_epochs": "train_iters", "learning_rate_multiplier": "lr"}


def _refuse(field: str, message: str) -> ApiError:
    return ApiError(422, "validation_error", f"{field}: {message}", field)


def _hyperparameters(method: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    block = method.get(kind, {})
    if not isinstance(block, dict) or not isinstance(block.get("hyperparameters", {}), dict):
        raise _refuse(f"{where}.{kind}", 'must be an object like {"hyperparameters": {...}}')
    unknown = set(block) - {"hyperparameters"}
    if unknown:
        raise _refuse(f"{where}.{kind}.{min(unknown)}", "unknown field (only hyperparameters)")
    return dict(block.get("hyperparameters", {}))


def _mapped(hyper: dict[str, Any], where: str) -> dict[str, Any]:
    out = {}
    for name, value in hyper.items():
        field = f"{where}.{name}"
        if value == "auto":
            continue
        if name in _REFUSED:
            raise _refuse(field, f'has no meaning here; set {_REFUSED[name]} on the spec (or send "auto")')
        if name not in _TAKEN:
            raise _refuse(field, f"unknown hyperparameter (known: {', '.join([*_TAKEN, *_REFUSED])})")
        if isinstance(value, bool) or not isinstance(value, float | int):
            raise _refuse(field, 'must be a number or "auto"')
        if name == "batch_size" and not isinstance(value, int):
            raise _refuse(field, 'must be an integer or "auto"')
        out[_TAKEN[name]] = value
    return out


def expand(raw: Any) -> Any:
    """``raw`` with a train body's ``method`` replaced by the fields it stands for (other bodies unchanged)."""
    if not isinstance(raw, dict) or "method" not in raw or raw.get("kind") != "train":
        return raw
    method, where = raw["method"], "method"
    if not isinstance(method, dict) or method.get("type") not in METHODS:
        raise _refuse(f"{where}.type", f"must be one of {', '.join(METHODS)}")
    kind = method["type"]
    unknown = set(method) - {"type", kind}
    if unknown:
        raise _refuse(f"{where}.{min(unknown)}", f"unknown field for method type {kind}")
    fields = _mapped(_hyperparameters(method, kind, where), f"{where}.{kind}.hyperparameters")
    if kind == "dpo":
        fields.update(stage="dpo", is_pairwise_dataset=True)
    elif raw.get("stage") == "dpo":
        raise _refuse(where, "asks for supervised training but the spec sets stage 'dpo'")
    out = {k: v for k, v in raw.items() if k != "method"}
    for name, value in fields.items():
        if name in out and out[name] != value:
            raise _refuse(where, f"asks for {name} {value!r} but the spec sets {name} {out[name]!r}")
        out[name] = value
    return out
