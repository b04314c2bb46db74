"""Issue 39, finding 1: every path a job reads goes through one guard, whatever the shape of its field.

The spec models' path-typed fields are enumerated here from their annotations (``DataPath``, ``OutputPath``,
``DataPathList`` at any depth: optional, list, dict values, nested models), so a field added later is covered without
editing this file. For each, a symbolic link leading into another team's area is refused at submission (422 naming
the field, ``lora_adapters.<name>`` for a dict) and by the engine's start-up check (``bad_input`` naming it). Then
the probe's replay: alpha's ``my-lora/`` of links to beta's adapter files, refused at submission, and when the links
are swapped in after the start-up check, refused by the adapter reader with nothing of beta's read.
"""

from __future__ import annotations

import os
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from core.paths import team_area, team_areas
from core.settings import Settings
from core_support import auth, make_token
from engine.contract import spec as contract
from engine.contract.guard import READ_ENV, WRITE_ENV, check_spec, path_fields, private_copy
from engine.contract.runfiles import BadInput
from engine.contract.spec import SPEC_CLASSES, ServeSpec, parse_spec

PATH_VALIDATORS = {contract._resolve_in_roots, contract._resolve_output, contract._resolve_list_in_roots}
ADAPTER_FILES = (".metadata", "__0_0.distcp", "meta.json")


def _is_path_type(annotation: Any, metadata: Any = ()) -> bool:
    metadata = list(metadata)
    if typing.get_origin(annotation) is typing.Annotated:
        metadata += annotation.__metadata__
    return any(getattr(m, "func", None) in PATH_VALIDATORS for m in metadata)


def _place(annotation: Any, metadata: Any, path: str) -> tuple[Any, str] | None:
    """A value of type ``annotation`` holding ``path`` at a path position, and the suffix naming that position
    (``.probe`` for a dict value, ``.0`` for a list item); None when the type holds no path."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if _is_path_type(annotation, metadata):  # a path, or a list of paths validated as one (``DataPathList``)
        base = args[0] if origin is typing.Annotated else annotation
        return ([path] if typing.get_origin(base) is list else path), ""
    if origin is typing.Annotated:
        return _place(args[0], (), path)
    if origin in (typing.Union, types.UnionType):
        return next((found for a in args if (found := _place(a, (), path))), None)
    if origin is dict:
        found = _place(args[1], (), path)
        return ({"probe": found[0]}, ".probe" + found[1]) if found else None
    if origin is list:
        found = _place(args[0], (), path)
        return ([found[0]], ".0" + found[1]) if found else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        inner = [(n, _place(f.annotation, f.metadata, path)) for n, f in annotation.model_fields.items()]
        return next((({n: v}, f".{n}{s}") for n, found in inner if found for v, s in [found]), None)
    return None


def _path_fields() -> list[tuple[str, str, bool]]:
    """(kind, field, output) for every path-typed field of every spec model, found by type."""
    found = []
    for kind, cls in SPEC_CLASSES.items():
        for name, field in cls.model_fields.items():
            if _place(field.annotation, field.metadata, "x") is not None:
                output = any(getattr(m, "func", None) is contract._resolve_output for m in _metadata(field))
                found.append((kind, name, output))
    return found


def _metadata(field: Any) -> list[Any]:
    args = typing.get_args(field.annotation)
    inner = [a.__metadata__ for a in args if typing.get_origin(a) is typing.Annotated]
    return [*field.metadata, *(m for group in inner for m in group)]


FIELDS = _path_fields()


def test_the_enumeration_finds_every_shape() -> None:
    names = {(kind, name) for kind, name, _ in FIELDS}
    assert {("serve", "lora_adapters"), ("serve", "load"), ("train", "data_path"), ("train", "save")} <= names
    assert ("preprocess", "output_prefix", True) in FIELDS and ("eval", "eval_data_path", False) in FIELDS


@pytest.fixture
def areas(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(alpha's area, beta's area), the engine's environment set as alpha's worker sets it."""
    env = team_areas(settings, "alpha").env()
    monkeypatch.setenv(WRITE_ENV, env[WRITE_ENV])
    monkeypatch.setenv(READ_ENV, env[READ_ENV])
    beta = team_area(settings, "beta")
    (beta / "adapter").mkdir()
    for name in ADAPTER_FILES:
        (beta / "adapter" / name).write_bytes(b"beta's adapter " + name.encode())
    return team_area(settings, "alpha"), beta


def _link_out(alpha: Path, beta: Path, output: bool) -> tuple[Path, Path]:
    """(a link into beta's area, a folder of alpha's holding links to beta's files); an output gets a link to a
    directory of beta's (where it would write)."""
    link = alpha / "theirs"
    link.symlink_to(beta / "adapter" if output else beta / "adapter" / "meta.json")
    folder = alpha / "mine"
    folder.mkdir()
    for name in ADAPTER_FILES:
        (folder / name).symlink_to(beta / "adapter" / name)
    return link, folder


@pytest.mark.parametrize(("kind", "name", "output"), FIELDS, ids=[f"{k}.{n}" for k, n, _ in FIELDS])
def test_a_link_into_another_teams_area_is_refused_in_every_path_field(
    kind: str, name: str, output: bool, settings: Settings, areas: tuple[Path, Path]
) -> None:
    alpha, beta = areas
    link, folder = _link_out(alpha, beta, output)
    field = SPEC_CLASSES[kind].model_fields[name]
    for probe in [link] if output else [link, folder]:
        placed = _place(field.annotation, field.metadata, str(probe))
        assert placed is not None
        value, suffix = placed
        where = name + suffix
        # at submission: the API's parse, with alpha's areas as the validation context
        with pytest.raises(ValidationError) as refused:
            parse_spec({"kind": kind, name: value}, **team_areas(settings, "alpha").context())
        mine = [e for e in refused.value.errors() if ".".join(map(str, e["loc"][1:])) == where]
        assert mine and "outside your data area" in mine[0]["msg"], (probe, refused.value.errors())
        # at run time: the link swapped in after submission, caught by the engine's start-up check
        with pytest.raises(BadInput) as caught:
            check_spec(_constructed(SPEC_CLASSES[kind], alpha, **{name: value}))
        assert caught.value.field == where and "outside this job's data area" in str(caught.value)


def _constructed(cls: type[BaseModel], alpha: Path, **fields: Any) -> BaseModel:
    """A spec as stored before the swap (not validated again): ``fields``, and every other required field set (a
    path-typed one to alpha's own ``in.jsonl``)."""
    for name, field in cls.model_fields.items():
        if field.is_required() and name not in fields:
            placed = _place(field.annotation, field.metadata, str(alpha / "in.jsonl"))
            fields[name] = placed[0] if placed else 1
    return cls.model_construct(**fields)


def test_a_link_inside_the_teams_own_area_is_kept(settings: Settings, areas: tuple[Path, Path]) -> None:
    """The rule is "no link leading out", not "no link": a folder linking to the team's own files passes both checks."""
    alpha, _ = areas
    (alpha / "tok" / "tokenizer.json").symlink_to(alpha / "in.jsonl")
    spec = parse_spec(
        {"kind": "eval", "load": "tok", "eval_data_path": "in.jsonl"}, **team_areas(settings, "alpha").context()
    )
    check_spec(spec)
    assert [r.field for r in path_fields(spec)] == ["load", "eval_data_path"]


def test_a_pipeline_steps_paths_are_walked_as_their_kinds(settings: Settings, areas: tuple[Path, Path]) -> None:
    alpha, beta = areas
    _, folder = _link_out(alpha, beta, output=False)
    step = {"kind": "eval", "load": str(folder), "eval_data_path": str(alpha / "in.jsonl")}
    body = {"kind": "pipeline", "steps": [{"name": "s", "spec": step}]}
    with pytest.raises(ValidationError, match=r"steps\.0\.spec\.load: .*/mine' holds '\.metadata'"):
        parse_spec(body, **team_areas(settings, "alpha").context())
    rows = path_fields(parse_spec(body))
    assert [(r.field, r.path) for r in rows] == [
        ("steps.0.spec.load", str(folder)),
        ("steps.0.spec.eval_data_path", str(alpha / "in.jsonl")),
    ]
    with pytest.raises(BadInput) as caught:
        check_spec(parse_spec(body))
    assert caught.value.field == "steps.0.spec.load"


def test_stolen_adapter_is_refused_at_submission(client: TestClient, settings: Settings, areas) -> None:
    """The probe's replay over the API: ``my-lora/`` holds links to beta's adapter files."""
    alpha, beta = areas
    (alpha / "my-lora").mkdir()
    for name in ADAPTER_FILES:
        (alpha / "my-lora" / name).symlink_to(beta / "adapter" / name)
    body = {"kind": "serve", "load": "tok", "lora_adapters": {"stolen-lora": "my-lora"}}
    answer = client.post("/v1/jobs", json=body, headers=auth(make_token(settings, "alpha")))
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "lora_adapters.stolen-lora"
    assert "symbolic link leading outside your data area" in answer.json()["message"]


def _unread(files: list[Path]) -> None:
    """Set each file's access time far back: any read moves it (relatime updates an access time older than the
    modification time)."""
    for file in files:
        os.utime(file, (0, file.stat().st_mtime))


def test_links_swapped_in_after_the_check_are_never_read(settings: Settings, areas: tuple[Path, Path]) -> None:
    """The run-time replay: ``my-lora/`` is a real folder at submission and at the engine's start-up check; the
    links to beta's files are swapped in before the adapter reader opens it, which refuses with nothing read."""
    from engine.serve.adapters import read_adapter

    alpha, beta = areas
    mine = alpha / "my-lora"
    mine.mkdir()
    for name in ADAPTER_FILES:
        (mine / name).write_bytes(b"alpha's own")
    spec = parse_spec(
        {"kind": "serve", "load": "tok", "lora_adapters": {"stolen-lora": "my-lora"}},
        **team_areas(settings, "alpha").context(),
    )
    assert isinstance(spec, ServeSpec)
    check_spec(spec)  # passes: the folder is alpha's own
    theirs = sorted((beta / "adapter").iterdir())
    control = beta / "control"
    control.write_bytes(b"x")
    _unread([*theirs, control])
    control.read_bytes()
    if control.stat().st_atime == 0:
        pytest.skip("this file system does not record reads (noatime)")
    for name in ADAPTER_FILES:  # the swap
        (mine / name).unlink()
        (mine / name).symlink_to(beta / "adapter" / name)
    with pytest.raises(BadInput) as refused:
        read_adapter(spec, "stolen-lora", spec.lora_adapters["stolen-lora"])
    assert refused.value.field == "lora_adapters.stolen-lora"
    assert "a symbolic link" in str(refused.value) and str(mine) in str(refused.value)
    assert [f.stat().st_atime for f in theirs] == [0] * len(theirs)  # nothing of beta's was read


def test_private_copy_reads_a_plain_folder(areas: tuple[Path, Path]) -> None:
    alpha, _ = areas
    (alpha / "lora" / "iter_0000001").mkdir(parents=True)
    (alpha / "lora" / "iter_0000001" / "meta.json").write_text("{}")
    (alpha / "lora" / "latest").write_text("1")
    with private_copy("lora_load", str(alpha / "lora")) as copy:
        got = sorted(str(p.relative_to(copy)) for p in Path(copy).rglob("*"))
        assert got == ["iter_0000001", "iter_0000001/meta.json", "latest"]
        assert copy != str(alpha / "lora")
    assert not Path(copy).exists()
    with pytest.raises(BadInput, match="at most 0 MiB"), private_copy("lora_load", str(alpha / "lora"), budget=2):
        pass


def test_a_real_adapter_reads_the_same_through_the_private_copy(
    settings: Settings, areas: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA checkpoint as our train jobs save it, in alpha's area: with the job's areas set (the copy) and without
    (the folder itself), the adapter reader gives the same tensors and settings."""
    import torch

    from convert_tiny import tiny_hf
    from engine.serve.adapters import read_adapter
    from tests.unit.serve_support import write_lora_checkpoint

    alpha, _ = areas
    hf = tiny_hf(alpha / "hf", tied=False, layers=2)
    lora = write_lora_checkpoint(hf, alpha / "lora", 1, 4, 8.0, ["linear_qkv", "linear_fc2"])
    spec = parse_spec({"kind": "serve", "load": str(hf), "lora_adapters": {"mine": str(lora)}})
    assert isinstance(spec, ServeSpec)
    check_spec(spec)
    copied = read_adapter(spec, "mine", str(lora))
    monkeypatch.delenv(WRITE_ENV)
    direct = read_adapter(spec, "mine", str(lora))
    assert (copied.r, copied.alpha, copied.targets) == (direct.r, direct.alpha, direct.targets)
    assert (copied.r, copied.alpha) == (4, 8.0)
    assert copied.lora.keys() == direct.lora.keys() and copied.lora
    assert all(torch.equal(copied.lora[k], direct.lora[k]) for k in direct.lora)
