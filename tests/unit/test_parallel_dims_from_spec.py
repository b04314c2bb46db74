"""``spec.parallel_dims`` is the only way a spec becomes ``ParallelDims``: no module builds dims by hand from a spec's
fields (``ParallelDims.from_world(world, spec.tensor_model_parallel_size, ...)``, or through a local ``tp = spec...``).

Dims built from a mesh, a checkpoint's layout or a single axis (``ParallelDims(pp=pp)`` to check a split) are not a
spec turned into dims and pass; so do the properties themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

# the checkout: the folder holding pyproject.toml (wherever tests/unit/ places this file)
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PACKAGES = ("app", "cli", "core", "engine", "worker")
THE_PROPERTIES = "engine/contract/spec/"  # ParallelArgs.parallel_dims, ConvertSpec.target_parallel_dims
# Known places, each with the reason it does not read spec.parallel_dims yet; the list only shrinks.
KNOWN = {
    # the world is the one torchrun started (WORLD_SIZE), which a standalone `python -m engine train` may set apart
    # from spec.resources; a BadInput names the field when they disagree
    "engine/train/job.py",
    # an eval job counts PP ranks as data-parallel ranks (no pipeline stages in generation), a rule of its own
    "engine/eval/job.py",
    # ServeSpec's validator makes world == TP, so spec.parallel_dims is the same: to switch (file in flight elsewhere)
    "engine/trace/serve.py",
}


def _reads_spec(node: ast.AST, tainted: set[str]) -> bool:
    """Whether ``node`` reads a field of ``spec`` (or of ``self`` inside a spec), or a local assigned from one."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "spec":
            return True
        if isinstance(sub, ast.Name) and sub.id in tainted:
            return True
    return False


def _is_dims_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    owner = func.value if isinstance(func, ast.Attribute) else None
    if name == "ParallelDims":
        return True
    return (
        name == "from_world" and isinstance(owner, (ast.Name, ast.Attribute)) and "ParallelDims" in ast.unparse(owner)
    )


def hand_built(source: str) -> list[int]:
    """Lines of ``source`` where dims are built from a spec's fields by hand."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        tainted: set[str] = set()
        for node in ast.walk(fn):  # locals assigned from a spec's fields: `tp = spec.tensor_model_parallel_size`
            if isinstance(node, ast.Assign) and _reads_spec(node.value, set()):
                for target in node.targets:
                    tainted.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        found += [n.lineno for n in ast.walk(fn) if _is_dims_call(n) and _reads_spec(n, tainted)]
    return sorted(set(found))


def test_the_finder_finds_dims_built_by_hand() -> None:
    direct = (
        "def f(spec):\n    return ParallelDims.from_world(spec.resources.world_size, spec.tensor_model_parallel_size)\n"
    )
    via_local = "def f(spec, world):\n    tp = spec.tensor_model_parallel_size\n    return layout.ParallelDims.from_world(world, tp=tp)\n"
    fine = "def f(spec, mesh):\n    d = spec.parallel_dims\n    return ParallelDims(dp=mesh['dp'].size()), d\n"
    assert hand_built(direct) == [2] and hand_built(via_local) == [3] and hand_built(fine) == []


def test_a_spec_becomes_dims_through_spec_parallel_dims_only() -> None:
    offenders = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            lines = hand_built(path.read_text())
            if lines and not rel.startswith(THE_PROPERTIES):
                offenders[rel] = lines
    assert set(offenders) - KNOWN == set(), f"dims built by hand from a spec (use spec.parallel_dims): {offenders}"
    assert KNOWN - set(offenders) == set(), "fixed: remove it from KNOWN"
