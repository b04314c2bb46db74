"""No import circle among the project's modules, imports under ``if TYPE_CHECKING:`` and inside functions included.

import-linter's acyclic contract leaves type-only imports out (``exclude_type_checking_imports``), so a circle made of
annotations alone (``engine.contract.layout -> model_config -> rope_scaling -> spec -> layout`` was one) passed it;
this reads every import statement from the source instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

# the checkout: the folder holding pyproject.toml (wherever tests/unit/ places this file)
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PACKAGES = ("app", "cli", "core", "engine", "llmjobs", "worker")
# Circles known and owned elsewhere, listed exactly so that a new one fails and a fixed one must leave the list
# (engine.train.grpo <-> engine.train.job was the last: engine.train.entry now picks the loop and hands grpo's loss in).
KNOWN: list[list[str]] = []


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` (module ``name``) imports anywhere in its text: ``from a import b`` counts as
    ``a.b`` when that is a module, else ``a``. A package's own ``__init__`` is not counted as imported by a submodule
    import (Python runs it, but it is not an edge any cycle finder draws)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {m for m in found if m in modules and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_type_only_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.contract import layout\n"
    modules = {"engine.contract.layout": Path("x"), "engine.contract.spec": Path("y")}
    probe = ROOT / "tests" / "unit" / "__probe_not_a_module__.py"
    assert not probe.exists()
    try:
        probe.write_text(source)
        assert imported(probe, "engine.contract.spec", modules) == {"engine.contract.layout"}
    finally:
        probe.unlink()


def test_no_import_circle_even_under_type_checking() -> None:
    modules = project_modules()
    graph = {name: imported(path, name, modules) for name, path in modules.items()}
    found = [c for c in cycles(graph) if c not in KNOWN]
    assert not found, "import circles (every import statement counted, TYPE_CHECKING and lazy ones too):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


def test_the_known_circles_are_still_circles() -> None:
    """A circle fixed must leave ``KNOWN`` (the list only shrinks)."""
    modules = project_modules()
    found = cycles({name: imported(path, name, modules) for name, path in modules.items()})
    assert [c for c in KNOWN if c not in found] == []
