"""Run-time path guard: every path of a spec is re-resolved right before it is opened, inside the job's data areas.

The API resolved the paths inside the submitting team's areas at submission (``core.paths``), but a file in a data
area may be replaced by a symlink afterwards (to another team's area, or out of the roots). The worker passes the
job's areas in ``LLMJOBS_DATA_AREAS`` (read and write) and ``LLMJOBS_READ_AREAS`` (read only), ``os.pathsep``
separated; the engine checks every path field at start (``check_spec``) and each output again right before writing
it (``check_output``); a path that now resolves elsewhere is a ``BadInput`` naming the field. Path fields are found by
their type (``DataPath``/``OutputPath``/``DataPathList``) in every shape: optional, lists, dict values
(``lora_adapters.<name>``), nested models and pipeline steps (``path_fields``), so a new field needs no list here.
LoRA adapter folders are read from a private copy made without following any link (``private_copy``). Outputs are staged
under a temporary name and renamed into place, so a symlink planted at an output's name is replaced, never
followed. Without the variables (``python -m engine`` run by hand) the engine trusts its user. No torch here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from engine.contract.nofollow import LinkInPath, copy_tree, links_below, open_dirs
from engine.contract.runfiles import BadInput
from engine.contract.spec import (
    REFERENCE_PLACEHOLDER_DIR,
    PipelineStep,
    _is_number,
    _resolve_in_roots,
    _resolve_list_in_roots,
    _resolve_output,
    parse_spec,
    substitute_references,
    within,
)

WRITE_ENV = "LLMJOBS_DATA_AREAS"
READ_ENV = "LLMJOBS_READ_AREAS"
COPY_BUDGET = 8 << 30  # bytes of one private copy (``private_copy``): LoRA adapters are far smaller


def areas_env(write: list[Path], read: list[Path]) -> dict[str, str]:
    """The environment variables that hand a job's areas to the engine (the worker sets them)."""
    return {WRITE_ENV: os.pathsep.join(map(str, write)), READ_ENV: os.pathsep.join(map(str, read))}


def _areas() -> tuple[list[Path], list[Path]] | None:
    if WRITE_ENV not in os.environ:
        return None
    split = [[Path(p) for p in os.environ.get(name, "").split(os.pathsep) if p] for name in (WRITE_ENV, READ_ENV)]
    return split[0], split[1]


@dataclasses.dataclass(frozen=True)
class PathField:
    """One path a spec sets: ``field`` names it as the API does (``load``, ``lora_adapters.<name>``,
    ``steps.0.spec.load``); ``prefix``: a data prefix (its files are ``<prefix>*`` beside it)."""

    field: str
    path: str
    output: bool
    prefix: bool = False


def _kind_of(annotation: object, metadata: Sequence[object] = ()) -> str | None:
    """'output', 'input', 'prefixes' or None: what the path validators on this type itself (its annotation, or
    metadata pydantic moved out of it) say it is; a type only holding paths (a list, a dict) is None here."""
    funcs = {getattr(m, "func", None) for m in metadata}
    if typing.get_origin(annotation) is typing.Annotated:
        funcs |= {getattr(m, "func", None) for m in getattr(annotation, "__metadata__", ())}
    if _resolve_output in funcs:
        return "output"
    if _resolve_list_in_roots in funcs:
        return "prefixes"
    return "input" if _resolve_in_roots in funcs else None


def _paths(
    value: Any, annotation: object, metadata: Sequence[object], field: str
) -> list[PathField]:  # Any: a field's value, walked by its annotation
    """The paths in ``value``, a field's value typed ``annotation``: found by type at any depth (optional, unions,
    lists, dict values, nested models), each named by its place (``lora_adapters.<name>``, ``<list>.<index>``)."""
    if value is None:
        return []
    kind = _kind_of(annotation, metadata)
    if kind == "prefixes":  # Megatron's blend: numbers between the prefixes are weights
        return [PathField(field, str(p), False, True) for p in value if not _is_number(str(p))]
    if kind is not None:
        return [PathField(field, str(value), kind == "output")]
    if isinstance(value, BaseModel):
        return path_fields(value, f"{field}.")
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _paths(value, args[0], (), field)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next((found for a in args if (found := _paths(value, a, (), field))), [])
    if isinstance(value, dict) and args:
        return [row for k, v in value.items() for row in _paths(v, args[-1], (), f"{field}.{k}")]
    if isinstance(value, (list, tuple)) and args:
        return [row for i, v in enumerate(value) for row in _paths(v, args[0], (), f"{field}.{i}")]
    return []


def path_fields(model: BaseModel, where: str = "") -> list[PathField]:
    """Every path ``model`` sets, found by the type of each field (see ``_paths``), nested models included. A
    pipeline step's spec (a plain dict) is walked as the spec of its kind; paths an earlier step will write (its
    references) are left to the step's own job, which is checked when it runs."""
    rows = []
    for name, info in type(model).model_fields.items():
        rows += _paths(getattr(model, name, None), info.annotation, info.metadata, where + name)
    if isinstance(model, PipelineStep):
        rows += _step_paths(model.spec, f"{where}spec.")
    return rows


def _step_paths(raw: dict[str, Any], where: str) -> list[PathField]:
    pending = Path("/") / REFERENCE_PLACEHOLDER_DIR
    try:
        step = parse_spec(substitute_references(raw, lambda ref, key: str(pending / ref / key)))
    except ValueError as err:  # pydantic's ValidationError: the submission refused it already
        raise BadInput(f"{where.rstrip('.')}: {err}", field=where.rstrip(".")) from err
    return [row for row in path_fields(step, where) if pending not in Path(row.path).parents]


def check_path(field: str, path: str | os.PathLike[str], *, output: bool) -> Path:
    """``path`` resolved (symlinks followed); BadInput naming ``field`` unless it lies inside the job's areas (an
    output: inside the writable ones). Without areas in the environment, ``path`` as it is."""
    areas = _areas()
    if areas is None:
        return Path(path)
    write, read = areas
    resolved = Path(path).resolve()
    allowed = write if output else [*write, *read]
    if not within(resolved, [a.resolve() for a in allowed]):
        what = "output" if output else "input"
        raise BadInput(
            f"{field}: {path} resolves to {resolved}, outside this job's data area (a symlink leaving "
            f"the area?); the {what} was refused",
            field=field,
        )
    return resolved


def check_output(field: str, path: str | os.PathLike[str]) -> Path:
    """``check_path`` for an output, right before it is written."""
    return check_path(field, path, output=True)


def check_spec(spec: BaseModel) -> None:
    """Every path ``spec`` sets (``path_fields``: by type, in any shape) inside the job's areas (see ``check_path``);
    BadInput naming the first that is not. Each link inside an input directory is checked too (a checkpoint's files),
    and a data prefix's files (``<prefix>*`` beside it)."""
    if _areas() is None:
        return
    for row in path_fields(spec):
        resolved = check_path(row.field, row.path, output=row.output)
        if row.output:
            continue
        prefixed = row.prefix and resolved.parent.is_dir()
        for entry in resolved.parent.glob(glob_escape(resolved.name) + "*") if prefixed else [resolved]:
            inside = check_path(row.field, entry, output=False)
            for link in links_below(inside) if inside.is_dir() else ():
                check_path(row.field, link, output=False)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


@contextlib.contextmanager
def private_copy(field: str, path: str, budget: int = COPY_BUDGET) -> Iterator[str]:
    """An input directory as a copy only this process can change, made by walking it from its area without following
    any link (``engine.contract.nofollow``): what is read from the copy is what lay inside the area, whatever link is
    swapped in after ``check_spec``. A link anywhere on the way or inside is a BadInput naming ``field``, as is more
    than ``budget`` bytes. Without areas in the environment, ``path`` itself; for a file, its checked location."""
    areas = _areas()
    if areas is None:
        yield path
        return
    resolved = check_path(field, path, output=False)
    if not resolved.is_dir():
        yield str(resolved)
        return
    area = next(a for a in (p.resolve() for p in [*areas[0], *areas[1]]) if within(resolved, [a]))
    try:
        opened = open_dirs(area, resolved.relative_to(area).parts)
    except OSError as err:  # LinkInPath, or ELOOP: a link swapped in on the way since check_path
        raise BadInput(
            f"{field}: {path} could not be reached without following a link ({err}); inputs are read without "
            "following links",
            field,
        ) from err
    try:
        with tempfile.TemporaryDirectory(prefix="llmjobs-input-") as tmp:
            copy = Path(tmp) / resolved.name
            try:
                copy_tree(opened[-1], copy, budget)
            except LinkInPath as err:
                raise BadInput(
                    f"{field}: {path} holds {err.name!r}, a symbolic link; folders are read without following links",
                    field,
                ) from err
            except (ValueError, OSError) as err:  # over the budget, a FIFO or device, a link swapped in (ELOOP)
                raise BadInput(
                    f"{field}: {path} could not be read as files and folders of at most {budget >> 20} MiB in all, "
                    f"links not followed ({err})",
                    field,
                ) from err
            yield str(copy)
    finally:
        for fd in opened:
            os.close(fd)
