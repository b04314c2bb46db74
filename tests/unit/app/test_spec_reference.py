"""The README's job spec and configuration references are generated from engine/contract/spec/ and core/settings.py and
must be current."""

from __future__ import annotations

from typing import get_args

from pydantic import BaseModel

from app.spec_reference import README, render, render_settings, updated
from core.settings import REPO_ROOT, Settings
from engine.contract.spec import SPEC_CLASSES, PipelineStep, Resources


def test_readme_spec_reference_is_current() -> None:
    text = README.read_text(encoding="utf-8")
    assert updated(text) == text, "README.md spec reference is out of date: run `python -m app.spec_reference`"


def test_reference_lists_every_field_of_every_kind() -> None:
    reference = render()
    for kind, model in SPEC_CLASSES.items():
        assert f"#### `{kind}`" in reference
        for name in model.model_fields:
            assert f"| `{name}` |" in reference


def _spec_models() -> list[type[BaseModel]]:
    """Every model a job spec is made of: the kinds and the nested objects they hold."""
    seen: list[type[BaseModel]] = []
    todo: list[type[BaseModel]] = [*SPEC_CLASSES.values(), Resources, PipelineStep]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            todo += [
                a
                for a in (field.annotation, *get_args(field.annotation))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ]
    return seen


def test_every_spec_field_has_a_description() -> None:
    """The README reference and the OpenAPI document show it: units, default, the MindSpeed flag mirrored."""
    bare = [
        f"{m.__name__}.{name}"
        for m in _spec_models()
        for name, field in m.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert bare == [], f"spec fields without a description: {bare}"


def test_the_description_check_sees_nested_models() -> None:
    names = {m.__name__ for m in _spec_models()}
    assert {"TrainSpec", "PipelineSpec", "Resources", "PipelineStep"} <= names


def test_every_setting_has_a_description_and_a_readme_row() -> None:
    bare = [name for name, field in Settings.model_fields.items() if not (field.description or "").strip()]
    assert bare == [], f"settings without a description: {bare}"
    reference = render_settings()
    assert all(f"| `LLMJOBS_{name.upper()}` |" in reference for name in Settings.model_fields)
    assert str(REPO_ROOT) not in reference  # machine paths are shown as <repo>/...
