"""The README's job spec reference is generated from engine/spec.py and must be current."""

from __future__ import annotations

from app.spec_reference import README, render, updated
from engine.spec import SPEC_CLASSES


def test_readme_spec_reference_is_current() -> None:
    text = README.read_text(encoding="utf-8")
    assert updated(text) == text, "README.md spec reference is out of date: run `python -m app.spec_reference`"


def test_reference_lists_every_field_of_every_kind() -> None:
    reference = render()
    for kind, model in SPEC_CLASSES.items():
        assert f"#### `{kind}`" in reference
        for name in model.model_fields:
            assert f"| `{name}` |" in reference
