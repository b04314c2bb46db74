"""The SDK's typed answers (``llmjobs/types.py``) are held to the served OpenAPI document: every answer schema's
field names and JSON types, and the terminal job states. The SDK imports nothing of the service, so this test is
where a new field of ``app/schemas.py`` that the SDK does not know fails."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest
from fastapi.testclient import TestClient

import llmjobs.types as sdk
from core.settings import Settings
from core.states import TERMINAL
from core_support import isolated_settings

# SDK TypedDict -> the OpenAPI component schema it mirrors
PAIRS = {
    "Job": "JobPublic",
    "JobError": "JobError",
    "JobDeleted": "JobDeleted",
    "Event": "EventPublic",
    "MetricPoint": "MetricPointPublic",
    "LogLine": "LogLinePublic",
    "Artifact": "ArtifactPublic",
    "Checkpoint": "CheckpointPublic",
    "File": "FilePublic",
    "FileDeleted": "FileDeleted",
}

_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


def _python_types(annotation: Any) -> set[str]:
    """The JSON types a Python annotation admits (``None`` as "null"; a TypedDict is an object)."""
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_python_types(a) for a in get_args(annotation)))
    if annotation is type(None):
        return {"null"}
    if annotation is Any:
        return {"any"}
    if typing.is_typeddict(annotation):
        return {"object"}
    return {_JSON[origin or annotation]}


def _schema_types(schema: dict[str, Any], components: dict[str, Any]) -> set[str]:
    """The JSON types an OpenAPI property admits, following ``$ref`` and ``anyOf``."""
    if "$ref" in schema:
        return _schema_types(components[schema["$ref"].rsplit("/", 1)[-1]], components)
    if "anyOf" in schema:
        return set().union(*(_schema_types(s, components) for s in schema["anyOf"]))
    if "type" in schema:
        return {schema["type"]}
    if "properties" in schema or "additionalProperties" in schema:
        return {"object"}
    return {"any"}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


@pytest.fixture
def components(client: TestClient) -> dict[str, Any]:
    return client.get("/openapi.json").json()["components"]["schemas"]


@pytest.mark.parametrize("sdk_name", sorted(PAIRS))
def test_sdk_answer_types_match_the_served_schema(sdk_name: str, components: dict[str, Any]) -> None:
    hints = get_type_hints(getattr(sdk, sdk_name))
    schema = components[PAIRS[sdk_name]]
    properties = schema["properties"]
    assert set(hints) == set(properties), f"{sdk_name} vs {PAIRS[sdk_name]}"
    for field, annotation in hints.items():
        served = _schema_types(properties[field], components)
        if "any" in served or "any" in _python_types(annotation):
            continue
        assert _python_types(annotation) == served, f"{sdk_name}.{field}"


def test_sdk_terminal_states_are_the_services() -> None:
    assert sdk.TERMINAL_STATES == {state.value for state in TERMINAL}
