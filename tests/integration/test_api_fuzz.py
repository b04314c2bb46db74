"""Property-based fuzzing of the whole API from its OpenAPI document (schemathesis), bounded in examples, on SQLite
and on PostgreSQL (a fresh database; the same generated cases are sent to an app on it).

Runs in-process with no worker attached, so accepted jobs only queue. Every response must be a non-5xx answer whose
body matches the documented schema, and every error must carry the {code, message, field} shape. The conformance
checks run too (issue 39): schema-valid requests accepted (ST202), schema-violating ones refused (ST201), 405 with an
``Allow`` naming the path's documented methods (ST204/ST205), a missing token answered 401 (ST203), the documented
media types (ST105). ``ACCEPTED_REFUSALS`` names the refusals a schema cannot express, each with why.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from schemathesis.checks import (
    allow_header_conformance,
    content_type_conformance,
    missing_required_header,
    negative_data_rejection,
    not_a_server_error,
    positive_data_acceptance,
    response_schema_conformance,
    unsupported_method,
)
from schemathesis.core.parameters import ParameterLocation

from app.main import create_app
from core_support import auth, fresh_postgres_database, isolated_settings, make_token
from engine.contract.spec import SPEC_CLASSES

MAX_EXAMPLES = 6

# Built at collection: schemathesis parametrizes from a schema object (its fixture loader fails on pytest 9).
_settings = isolated_settings(Path(tempfile.mkdtemp(prefix="llmjobs-fuzz-")))
_app = create_app(_settings, reconcile=False)
_token = make_token(_settings, "fuzz")
# Schema-valid requests the server still refuses, by rules JSON Schema cannot state (SECURITY.md, schemathesis):
ACCEPTED_REFUSALS = {
    # Upload paths: at most 255 bytes per name (bytes, not characters), no '.'/'..'/empty parts, reserved prefixes.
    "DELETE /v1/files/{path}": (422,),
    "PUT /v1/files/{path}": (422,),
    "GET /v1/files": (422,),
    # after= names a job: one that does not exist (or is another team's) is 400 invalid_cursor.
    "GET /v1/jobs": (400,),
    # The body is read raw (app.api.openai_compat), so the document has no requestBody: no body, or one without
    # a model, is OpenAI's 400.
    "POST /v1/chat/completions": (400,),
    "POST /v1/completions": (400,),
    "POST /tokenize": (400,),
    "POST /detokenize": (400,),
    "POST /v1/load_lora_adapter": (400,),
    "POST /v1/unload_lora_adapter": (400,),
    # The URL's host must resolve, to public addresses only (the SSRF guard, core.net_guard).
    "POST /v1/webhooks": (422,),
}
DEFAULT_ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429"]
CONFIG = schemathesis.Config.from_dict(
    {
        "operations": [
            {
                "include-name": name,
                "checks": {"positive_data_acceptance": {"expected-statuses": [*DEFAULT_ACCEPTED, *map(str, codes)]}},
            }
            for name, codes in ACCEPTED_REFUSALS.items()
        ]
    }
)
CHECKS = [
    not_a_server_error,
    response_schema_conformance,
    content_type_conformance,
    positive_data_acceptance,
    negative_data_rejection,
    missing_required_header,
    unsupported_method,
    allow_header_conformance,
]
schema = schemathesis.openapi.from_asgi("/openapi.json", _app, config=CONFIG).exclude(path_regex="/stream$")
# Generating bodies from the spec union (hundreds of fields) costs schemathesis ~40 s of strategy building, so
# submissions are fuzzed by test_submit_never_breaks below: real field names of each kind with arbitrary JSON values.
reads = schema.exclude(method="POST", path="/v1/jobs")
BOUNDED = dict(deadline=None, phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def spec_bodies(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(SPEC_CLASSES)))
    names = draw(st.lists(st.sampled_from(sorted(SPEC_CLASSES[kind].model_fields)), max_size=6, unique=True))
    return {"kind": kind, **{name: draw(JSON) for name in names}}


@dataclass
class Target:
    """An app to send the cases to, and a token of it."""

    app: Any
    token: str


@pytest.fixture(scope="module")
def postgres_target(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    with fresh_postgres_database(postgres_url, migrated=True) as url:
        settings = isolated_settings(tmp_path_factory.mktemp("fuzz-pg"), database_url=url)
        yield Target(create_app(settings, reconcile=False), make_token(settings, "fuzz"))


def _headers(case: Any, target: Target) -> dict[str, str]:
    """The team's token, unless the case's headers are the invalid part: a negative case that drops or mangles
    ``Authorization`` must reach the server as generated (our token over it would turn it into a valid request, and
    the negative-data check would then call its acceptance a failure). Any other header negated goes without a token
    too: 401 is an accepted refusal of a negative case."""
    meta = case.meta
    header = meta.components.get(ParameterLocation.HEADER) if meta is not None else None
    return {} if header is not None and header.mode.is_negative else auth(target.token)


def _check_read(case: Any, target: Target) -> None:
    response = case.call_and_validate(app=target.app, headers=_headers(case, target), checks=CHECKS)
    if response.status_code >= 400:
        body = response.json()
        if "error" in body and "openai" in (case.operation.tags or ()):  # OpenAI's shape on its own routes
            assert {"message", "type", "param", "code"} <= set(body["error"]), body
        else:
            assert {"code", "message", "field"} <= set(body), body


def _check_submit(body: dict[str, Any], target: Target) -> None:
    with TestClient(target.app) as client:
        response = client.post("/v1/jobs", json=body, headers=auth(target.token))
    assert response.status_code in (201, 400, 422), response.text  # 400: JSON the input guard refuses (huge ints)
    if response.status_code != 201:
        error = response.json()
        assert isinstance(error["code"], str) and error["message"] and "field" in error


@reads.parametrize()
@hypothesis_settings(max_examples=MAX_EXAMPLES, **BOUNDED)
def test_api_never_breaks(case: Any) -> None:
    _check_read(case, Target(_app, _token))


@given(body=spec_bodies())
@hypothesis_settings(max_examples=40, **BOUNDED)
def test_submit_never_breaks(body: dict[str, Any]) -> None:
    _check_submit(body, Target(_app, _token))


@pytest.mark.postgres
@reads.parametrize()
@hypothesis_settings(max_examples=MAX_EXAMPLES, **BOUNDED)
def test_api_never_breaks_on_postgres(case: Any, postgres_target: Target) -> None:
    _check_read(case, postgres_target)


@pytest.mark.postgres
@given(body=spec_bodies())
@hypothesis_settings(max_examples=40, **BOUNDED)
def test_submit_never_breaks_on_postgres(body: dict[str, Any], postgres_target: Target) -> None:
    _check_submit(body, postgres_target)
