"""The layering that import-linter cannot see: the HTTP layer builds no SQL itself (routes call the core)."""

from __future__ import annotations

import ast
from pathlib import Path

from core.settings import REPO_ROOT

SQL_BUILDERS = {"select", "update", "delete", "insert", "text", "func"}


def _sql_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            found += [
                f"{path.relative_to(REPO_ROOT)}:{node.lineno} {a.name}" for a in node.names if a.name in SQL_BUILDERS
            ]
    return found


def test_the_http_layer_builds_no_sql() -> None:
    offenders = [hit for path in sorted((REPO_ROOT / "app").rglob("*.py")) for hit in _sql_imports(path)]
    assert offenders == [], f"query through core/ instead: {offenders}"


def test_the_check_sees_a_query_builder() -> None:
    probe = REPO_ROOT / "core" / "records.py"
    assert any(hit.endswith(" select") for hit in _sql_imports(probe))
