"""Every private torch name the engine relies on still exists: a torch upgrade that drops one fails its own case here,
named, instead of somewhere inside a training run (engine/torch_compat.py says why each is used)."""

from __future__ import annotations

import importlib

import pytest

from engine import torch_compat


@pytest.mark.parametrize(
    ("module", "path"), torch_compat.PRIVATE_NAMES, ids=[f"{m}.{p}" for m, p in torch_compat.PRIVATE_NAMES]
)
def test_private_torch_name_exists(module: str, path: str) -> None:
    obj = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(obj, part), f"torch no longer has {module}.{path}: see engine/torch_compat.py"
        obj = getattr(obj, part)


def test_compat_exports_resolve() -> None:
    for name in torch_compat.__all__:
        assert getattr(torch_compat, name) is not None, name
    assert torch_compat.in_backward() is False
