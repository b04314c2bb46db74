"""A train job's checkpoints as objects: what its ``save`` directory holds, with the step metrics at each iteration.

Read from disk each time (the directory is the truth: retention may have removed old ones): the periodic training
checkpoints ``<save>/train_state/iter_*`` (DCP: model, optimizer unless ``no_save_optim``, RNG; resumable) and the
final export ``<save>/iter_*`` named by ``<save>/latest_checkpointed_iteration.txt`` (Megatron mcore, or LoRA
adapters). Both load in eval (``load``) and convert (``load_dir``); LoRA-only ones need their base model as well.
What each holds is read from its tensors (``engine.contract.inspect.contents``), and each has its own reference
(``{"job", "iteration", "format"}``; without ``format`` the final export is meant over a training state).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.auth import Principal, load_visible
from core.errors import ApiError
from core.models import Job, MetricPoint
from core.records import redone
from core.stored_spec import stored_spec
from engine.contract import inspect

TRACKER = "latest_checkpointed_iteration.txt"
FORMATS = ("mcore", "training_state")
STEP_METRICS = ("lm_loss", "val_lm_loss", "grad_norm")


def save_dir(job: Job) -> Path:
    return Path(stored_spec(job.spec).save or Path(job.run_dir) / "checkpoints")


def _iteration(name: str) -> int | None:
    digits = name.removeprefix("iter_")
    return int(digits) if name.startswith("iter_") and digits.isdigit() else None


def _training_states(save: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted((save / "train_state").glob("iter_*")):
        iteration = _iteration(path.name)
        if iteration is None or not (path / "meta.json").is_file():
            continue  # an unfinished save (iter_*.tmp) is not a checkpoint
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        held = inspect.contents(path) or inspect.FULL
        found.append(
            {
                "iteration": iteration,
                "format": "training_state",
                "model_path": str(path),
                "optimizer_path": str(path) if meta.get("has_optimizer") else None,
                "lora": held.lora,
                "needs_base_model": held.needs_base_model,
            }
        )
    return found


def _final(save: Path) -> list[dict[str, Any]]:
    try:
        text = (save / TRACKER).read_text().strip()
    except OSError:
        return []
    if not text.isdigit() or not (save / f"iter_{int(text):07d}").is_dir():
        return []
    held = inspect.contents(save) or inspect.FULL  # read from its tensors: a LoRA run's export holds adapters only
    return [
        {
            "iteration": int(text),
            "format": "mcore",
            "model_path": str(save),
            "optimizer_path": None,
            "lora": held.lora,
            "needs_base_model": held.needs_base_model,
        }
    ]


def list_checkpoints(session: Session, job: Job) -> list[dict[str, Any]]:
    """Newest last; each with the job's step metrics at its iteration and how to refer to it."""
    if job.kind != "train":
        return []
    save = save_dir(job)
    items = sorted(_training_states(save) + _final(save), key=lambda c: (c["iteration"], c["format"] == "mcore"))
    iterations = sorted({c["iteration"] for c in items})
    query = select(MetricPoint.step, MetricPoint.name, MetricPoint.value).where(
        MetricPoint.job_id == job.id,
        MetricPoint.step.in_(iterations),
        MetricPoint.name.in_(STEP_METRICS),
        MetricPoint.rank.is_(None),
        ~redone(MetricPoint),  # a step a retry did again: the latest attempt's value
    )
    metrics: dict[int, dict[str, float | None]] = {}
    for step, name, value in session.execute(query).all() if iterations else []:
        metrics.setdefault(step, {})[name] = value
    base = stored_spec(job.spec).load
    for item in items:
        item["metrics"] = metrics.get(item["iteration"], {})
        # adapters alone load over the run's own base (a reference fills it in), so need one to be evaluated
        item["evaluable"] = not item["needs_base_model"] or bool(base)
        item["convertible"] = True
        item["reference"] = {"job": job.id, "iteration": item["iteration"], "format": item["format"]}
    return items


# spec field -> the kinds whose field may name a checkpoint by reference
REFERENCE_FIELDS = {"load": ("eval", "serve"), "load_dir": ("convert",)}


def _pick(items: list[dict[str, Any]], iteration: Any, field: str, fmt: str | None = None) -> dict[str, Any]:
    matches = [c for c in items if c["iteration"] == iteration]
    if fmt is not None and matches:
        matches = [c for c in matches if c["format"] == fmt]
        if not matches:
            raise ApiError(
                422,
                "validation_error",
                f"{field}.format: the job has no {fmt} checkpoint at iteration {iteration}",
                f"{field}.format",
            )
    if not matches:
        have = ", ".join(str(c["iteration"]) for c in items) or "none"
        raise ApiError(
            422,
            "validation_error",
            f"{field}.iteration: the job has no checkpoint at iteration {iteration!r} (it has: {have})",
            f"{field}.iteration",
        )
    return matches[-1]  # the final export over a training state of the same iteration


def _referenced_job(session: Session, principal: Principal, job_id: str, field: str) -> Job:
    """The train job a reference names, by the same visibility rule as GET /v1/jobs/{id}; a job that does not exist
    or that another team owns reads the same (no existence leak), as a 422 on the body's field."""
    try:
        job = load_visible(session, Job, job_id, principal, "job")
    except ApiError as err:
        if err.status != 404:
            raise
        raise ApiError(422, "validation_error", f"{field}: no job {job_id}", field) from err
    if job.kind != "train":
        raise ApiError(
            422,
            "validation_error",
            f"{field}: job {job_id} is a {job.kind} job; checkpoints come from train jobs",
            field,
        )
    return job


def expand_references(session: Session, principal: Principal, raw: Any, where: str = "") -> Any:
    """``{"job": ID, "iteration": N}`` in an eval's ``load`` or a convert's ``load_dir`` replaced by that checkpoint's
    path (a LoRA checkpoint becomes ``lora_load`` over the training job's own ``load``), and in a serve job's
    ``lora_adapters`` values by the LoRA checkpoint's path; pipelines: every step."""
    if not isinstance(raw, dict):
        return raw
    if raw.get("kind") == "pipeline" and isinstance(raw.get("steps"), list):
        steps = [
            {**s, "spec": expand_references(session, principal, s["spec"], f"{where}steps.{i}.spec.")}
            if isinstance(s, dict) and "spec" in s
            else s
            for i, s in enumerate(raw["steps"])
        ]
        return {**raw, "steps": steps}
    out = dict(raw)
    for name, kinds in REFERENCE_FIELDS.items():
        ref = raw.get(name)
        if raw.get("kind") not in kinds or not isinstance(ref, dict):
            continue
        field = f"{where}{name}"
        job, chosen = _resolve(session, principal, ref, field)
        out[name] = chosen["model_path"]
        if chosen["needs_base_model"]:
            base = stored_spec(job.spec).load
            if not base:
                raise ApiError(
                    422,
                    "validation_error",
                    f"{field}: the checkpoint holds LoRA adapters and its job has no base model (load)",
                    field,
                )
            out[name], out["lora_load"] = base, chosen["model_path"]
    if raw.get("kind") == "serve" and isinstance(raw.get("lora_adapters"), dict):
        out["lora_adapters"] = {
            n: _adapter_path(session, principal, ref, f"{where}lora_adapters.{n}") if isinstance(ref, dict) else ref
            for n, ref in raw["lora_adapters"].items()
        }
    return out


def _resolve(session: Session, principal: Principal, ref: dict[str, Any], field: str) -> tuple[Job, dict[str, Any]]:
    """The train job and the checkpoint (as ``list_checkpoints`` lists it) that ``{"job", "iteration"}`` names."""
    iteration, fmt = ref.get("iteration"), ref.get("format")
    if (
        not {"job", "iteration"} <= set(ref) <= {"job", "iteration", "format"}
        or not isinstance(ref["job"], str)
        or not isinstance(iteration, int)
        or isinstance(iteration, bool)
        or fmt not in (None, *FORMATS)
    ):
        raise ApiError(
            422,
            "validation_error",
            f'{field}: a path, or {{"job": ID, "iteration": N}} (optionally "format": "mcore" or "training_state")',
            field,
        )
    job = _referenced_job(session, principal, ref["job"], f"{field}.job")
    return job, _pick(list_checkpoints(session, job), iteration, field, fmt)


def _adapter_path(session: Session, principal: Principal, ref: dict[str, Any], field: str) -> str:
    """A serve job's adapter by reference: the LoRA checkpoint's path (a full-weights checkpoint is refused)."""
    _, chosen = _resolve(session, principal, ref, field)
    if not chosen["lora"]:
        raise ApiError(
            422, "validation_error", f"{field}: that checkpoint holds full weights, not LoRA adapters", field
        )
    return str(chosen["model_path"])
