"""Run-time path guard: every path of a spec is re-resolved right before it is opened, inside the job's data areas.

The API resolved the paths inside the submitting team's areas at submission (``core.paths``), but a file in a data
area may be replaced by a symlink afterwards (to another team's area, or out of the roots). The worker passes the
job's areas in ``LLMJOBS_DATA_AREAS`` (read and write) and ``LLMJOBS_READ_AREAS`` (read only), ``os.pathsep``
separated; the engine checks every path field at start (``check_spec``) and each output again right before writing
it (``check_output``); a path that now resolves elsewhere is a ``BadInput`` naming the field. Outputs are staged
under a temporary name and renamed into place, so a symlink planted at an output's name is replaced, never
followed. Without the variables (``python -m engine`` run by hand) the engine trusts its user. No torch here.
"""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Any

from engine.contract.runfiles import BadInput
from engine.contract.spec import JobBase, _is_number, _resolve_in_roots, _resolve_list_in_roots, _resolve_output, within

WRITE_ENV = "LLMJOBS_DATA_AREAS"
READ_ENV = "LLMJOBS_READ_AREAS"
_INPUT_CHECKS = (_resolve_in_roots, _resolve_list_in_roots)


def areas_env(write: list[Path], read: list[Path]) -> dict[str, str]:
    """The environment variables that hand a job's areas to the engine (the worker sets them)."""
    return {WRITE_ENV: os.pathsep.join(map(str, write)), READ_ENV: os.pathsep.join(map(str, read))}


def _areas() -> tuple[list[Path], list[Path]] | None:
    if WRITE_ENV not in os.environ:
        return None
    split = [[Path(p) for p in os.environ.get(name, "").split(os.pathsep) if p] for name in (WRITE_ENV, READ_ENV)]
    return split[0], split[1]


def _kind_of(annotation: Any, metadata: list[Any] | tuple[Any, ...] = ()) -> str | None:
    """'output', 'input' or None: what the validators of a field (its annotation, or metadata pydantic moved out of
    it) say it is."""
    funcs = {getattr(m, "func", None) for m in metadata}
    if typing.get_origin(annotation) is typing.Annotated:
        funcs |= {getattr(m, "func", None) for m in annotation.__metadata__}
    if _resolve_output in funcs:
        return "output"
    if funcs & set(_INPUT_CHECKS):
        return "input"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next((k for k in (_kind_of(a) for a in typing.get_args(annotation)) if k), None)
    return None


def path_fields(spec: JobBase) -> list[tuple[str, str, bool]]:
    """(field, path, is_output) for every path the spec sets (a list field gives one row per path)."""
    rows = []
    for name, field in type(spec).model_fields.items():
        kind, value = _kind_of(field.annotation, field.metadata), getattr(spec, name)
        if kind is None or value is None:
            continue
        for path in value if isinstance(value, list) else [value]:
            if not (isinstance(path, str) and _is_number(path)):
                rows.append((name, str(path), kind == "output"))
    return rows


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


def check_spec(spec: JobBase) -> None:
    """Every path field of ``spec`` inside the job's areas (see ``check_path``); BadInput naming the first that is not.
    An input directory's symlinks are checked too (a model directory's files), and a data prefix's files
    (``<prefix>*`` beside it)."""
    if _areas() is None:
        return
    for field, path, output in path_fields(spec):
        resolved = check_path(field, path, output=output)
        if output:
            continue
        if field == "data_path" and resolved.parent.is_dir():
            for entry in resolved.parent.glob(glob_escape(resolved.name) + "*"):
                check_path(field, entry, output=False)
        elif resolved.is_dir():
            for folder, dirs, files in os.walk(resolved):
                for name in (*dirs, *files):
                    if os.path.islink(os.path.join(folder, name)):
                        check_path(field, os.path.join(folder, name), output=False)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
