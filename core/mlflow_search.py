"""MLflow's search grammar over runs held in memory: ``filter`` strings (``metrics.loss < 2 AND params.lr = '0.1'``)
and ``order_by`` clauses, as ``MlflowClient.search_runs`` sends them. The grammar is MLflow's (``SearchUtils``):
entity-prefixed keys, quoted string values, numeric metric values, clauses joined by AND only."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.mlflow_errors import MlflowError

_ENTITIES = {
    "metric": "metrics",
    "metrics": "metrics",
    "param": "params",
    "params": "params",
    "parameter": "params",
    "parameters": "params",
    "tag": "tags",
    "tags": "tags",
    "attribute": "attributes",
    "attributes": "attributes",
    "attr": "attributes",
    "run": "attributes",
}
_NUMERIC_ATTRIBUTES = {"start_time", "end_time", "created"}
_STRING_ATTRIBUTES = {"status", "run_name", "run_id", "user_id", "artifact_uri", "lifecycle_stage"}
_ATTRIBUTE_ALIASES = {"created": "start_time", "Created": "start_time", "Run name": "run_name", "run name": "run_name"}
_KEY = r"(?:`[^`]+`|\"[^\"]+\"|[\w.\-/:]+?)"
_CLAUSE = re.compile(
    rf"""\s*(?:(?P<entity>\w+)\.)?(?P<key>{_KEY})\s*
    (?P<op>!=|<=|>=|=|<|>|NOT\s+IN\b|IN\b|NOT\s+ILIKE\b|ILIKE\b|NOT\s+LIKE\b|LIKE\b)\s*
    (?P<value>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\([^)]*\)|[-+]?[\w.]+)\s*""",
    re.IGNORECASE | re.VERBOSE,
)
_AND = re.compile(r"AND\b", re.IGNORECASE)
_ORDER = re.compile(
    r"^\s*(?:(?P<entity>\w+)\.)?(?P<key>`[^`]+`|\"[^\"]+\"|[\w.\-/: ]+?)\s*(?P<dir>ASC|DESC)?\s*$", re.IGNORECASE
)


@dataclass
class RunView:
    """One run as search sees it: its attributes, latest metric values, params and tags."""

    attributes: dict[str, Any]
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metric_json: list[dict[str, Any]] = field(default_factory=list)  # the latest points, as the API returns them

    def value(self, entity: str, key: str) -> Any:
        source: dict[str, Any] = getattr(self, entity)
        return source.get(key)


@dataclass(frozen=True)
class Clause:
    entity: str
    key: str
    op: str
    value: Any

    def matches(self, run: RunView) -> bool:
        have = run.value(self.entity, self.key)
        if have is None:
            return False
        return _compare(self.op, have, self.value)


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "`\"'":
        return re.sub(r"\\(.)", r"\1", text[1:-1])
    return text


def _entity_key(entity: str | None, key: str, where: str) -> tuple[str, str]:
    name = _ENTITIES.get((entity or "attributes").lower())
    if name is None:
        raise MlflowError(
            f"{where}: invalid entity type {entity!r}; use metrics, params, tags or attributes (datasets are not "
            "supported here)"
        )
    key = _unquote(key.strip())
    if name == "attributes":
        key = _ATTRIBUTE_ALIASES.get(key, key)
        if key not in _NUMERIC_ATTRIBUTES | _STRING_ATTRIBUTES:
            allowed = ", ".join(sorted(_NUMERIC_ATTRIBUTES | _STRING_ATTRIBUTES))
            raise MlflowError(f"{where}: invalid attribute key {key!r}; use one of {allowed}")
    return name, key


def _literal(entity: str, key: str, op: str, text: str) -> Any:
    numeric = entity == "metrics" or (entity == "attributes" and key in _NUMERIC_ATTRIBUTES)
    if op in ("IN", "NOT IN"):
        if numeric or not (text.startswith("(") and text.endswith(")")):
            raise MlflowError(f"filter: {op} takes a parenthesised list of quoted strings, for {entity}.{key}")
        items = re.findall(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", text)
        return frozenset(_unquote(item) for item in items)
    if numeric:
        if op not in ("=", "!=", "<", "<=", ">", ">="):
            raise MlflowError(f"filter: {op} does not compare numbers ({entity}.{key})")
        try:
            return float(text)
        except ValueError:
            raise MlflowError(f"filter: {entity}.{key} compares with a number, not {text}") from None
    if not (text[:1] in "'\"" and text[-1:] == text[:1]):
        raise MlflowError(f"filter: the value of {entity}.{key} must be a quoted string, not {text}")
    if op not in ("=", "!=", "LIKE", "ILIKE", "NOT LIKE", "NOT ILIKE"):
        raise MlflowError(f"filter: {op} does not compare strings ({entity}.{key})")
    return _unquote(text)


def _like(pattern: str, text: str, flags: int) -> bool:
    regex = "".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, text, flags | re.DOTALL) is not None


def _compare(op: str, have: Any, want: Any) -> bool:
    if isinstance(want, float):
        if isinstance(have, str):
            return False
        number = float(have)
        if math.isnan(number):
            return op == "!="
    tests: dict[str, Callable[[Any, Any], bool]] = {
        "=": lambda a, b: a == b,
        "!=": lambda a, b: a != b,
        "<": lambda a, b: a < b,
        "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b,
        "LIKE": lambda a, b: _like(b, str(a), 0),
        "ILIKE": lambda a, b: _like(b, str(a), re.IGNORECASE),
        "NOT LIKE": lambda a, b: not _like(b, str(a), 0),
        "NOT ILIKE": lambda a, b: not _like(b, str(a), re.IGNORECASE),
        "IN": lambda a, b: str(a) in b,
        "NOT IN": lambda a, b: str(a) not in b,
    }
    return tests[op](float(have) if isinstance(want, float) else have, want)


def parse_filter(text: str | None) -> list[Clause]:
    """The AND-joined clauses of a filter string; INVALID_PARAMETER_VALUE naming what is wrong."""
    clauses: list[Clause] = []
    text = (text or "").strip()
    at = 0
    while at < len(text):
        found = _CLAUSE.match(text, at)
        if found is None:
            raise MlflowError(f"filter: cannot parse {text[at:][:80]!r} (e.g. metrics.loss < 2 AND params.x = 'y')")
        entity, key = _entity_key(found["entity"], found["key"], "filter")
        op = " ".join(found["op"].upper().split())
        clauses.append(Clause(entity, key, op, _literal(entity, key, op, found["value"])))
        at = found.end()
        if at < len(text):
            joined = _AND.match(text, at)
            if joined is None:
                raise MlflowError(f"filter: clauses are joined by AND only, at {text[at:][:40]!r}")
            at = joined.end()
            if at >= len(text.rstrip()):
                raise MlflowError("filter: AND at the end of the string")
    return clauses


@dataclass(frozen=True)
class OrderKey:
    entity: str
    key: str
    descending: bool


def parse_order_by(items: list[str]) -> list[OrderKey]:
    keys = []
    for item in items:
        found = _ORDER.match(item)
        if found is None:
            raise MlflowError(f"order_by: cannot parse {item!r} (e.g. metrics.loss ASC)")
        entity, key = _entity_key(found["entity"], found["key"], "order_by")
        keys.append(OrderKey(entity, key, (found["dir"] or "ASC").upper() == "DESC"))
    return keys


def _sort_value(run: RunView, order: OrderKey) -> Any:
    value = run.value(order.entity, order.key)
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def search(runs: list[RunView], clauses: list[Clause], order: list[OrderKey]) -> list[RunView]:
    """The runs every clause matches, ordered by ``order`` then newest start first then run id; a run that lacks
    an ordering key comes after those that have it, in either direction."""
    kept = [run for run in runs if all(clause.matches(run) for clause in clauses)]
    keys = [*order, OrderKey("attributes", "start_time", True), OrderKey("attributes", "run_id", False)]
    for key in reversed(keys):  # stable sorts, least significant key first
        present = [run for run in kept if _sort_value(run, key) is not None]
        missing = [run for run in kept if _sort_value(run, key) is None]
        present.sort(key=lambda run, k=key: _sort_value(run, k), reverse=key.descending)  # type: ignore[misc]
        kept = present + missing
    return kept
