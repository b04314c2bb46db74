"""The serving request is typed once (``engine.contract.serve_request``, issue 46): the API's OpenAI routes build it,
the engine's server reads it, a remote eval sends it. Every option has an example below: a field added to
``SamplingOptions`` fails here until it has one, and then must travel from an OpenAI body, and from a remote eval,
through the wire form into the engine's options unchanged."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from app.openai_format import CHAT_FIELDS, COMPLETION_FIELDS, SAMPLING_FIELDS, OpenAIError, chat_request
from app.openai_format import completion_request as text_request
from engine.contract.runfiles import BadInput
from engine.contract.serve_request import (
    OPTION_FIELDS,
    REQUEST_FIELDS,
    RequestError,
    SamplingOptions,
    ServeRequest,
)
from engine.contract.spec import EvalSpec
from engine.eval.remote import RemoteOptions, generate_one
from engine.serve.protocol import BadRequest, parse_options, parse_request
from engine.serve.sampling import RequestOptions

# A valid value other than the default, per option
EXAMPLES: dict[str, Any] = {
    "max_tokens": 7,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "seed": 11,
    "n": 2,
    "stop": ("x", "yz"),
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.2,
    "logprobs": 3,
}
# A value of the right JSON type out of range, per option (stop: an empty string)
OUT_OF_RANGE: dict[str, Any] = {
    "max_tokens": 0,
    "temperature": 2.5,
    "top_p": 0.0,
    "top_k": -1,
    "seed": 2**64,
    "n": 17,
    "stop": ["a", ""],
    "presence_penalty": 3.0,
    "frequency_penalty": -3,
    "repetition_penalty": 0,
    "logprobs": 21,
}
MESSAGES = [{"role": "user", "content": "hi"}]


def test_every_option_has_an_example() -> None:
    assert set(EXAMPLES) == set(OUT_OF_RANGE) == set(OPTION_FIELDS)
    assert all(EXAMPLES[f.name] != f.default for f in dataclasses.fields(SamplingOptions))


def test_the_engine_adds_no_field_to_the_options() -> None:
    assert dataclasses.fields(RequestOptions) == dataclasses.fields(SamplingOptions)
    assert set(SAMPLING_FIELDS) | {"max_tokens", "logprobs"} == set(OPTION_FIELDS)
    assert set(SAMPLING_FIELDS) <= CHAT_FIELDS & COMPLETION_FIELDS


def _openai(name: str, value: Any, chat: bool) -> dict[str, Any]:
    """OpenAI's spelling of one option (``max_tokens``, chat's ``logprobs``) in a body."""
    value = list(value) if isinstance(value, tuple) else value
    if chat and name == "max_tokens":
        return {"max_completion_tokens": value}
    if chat and name == "logprobs":
        return {"logprobs": True, "top_logprobs": value}
    return {name: value}


@pytest.mark.parametrize("name", OPTION_FIELDS)
def test_an_option_travels_from_an_openai_body_to_the_engine(name: str) -> None:
    value = EXAMPLES[name]
    chat = chat_request({"model": "m", "messages": MESSAGES, **_openai(name, value, chat=True)})
    text = text_request({"model": "m", "prompt": "hi", **_openai(name, value, chat=False)})
    for request in (chat, text):
        assert getattr(request.options, name) == value
        wire = json.loads(json.dumps(request.to_json()))  # what the API's proxy posts
        assert ServeRequest.from_json(wire) == request
        assert getattr(parse_options(wire), name) == value


@contextmanager
def recording_deployment() -> Iterator[tuple[str, list[RequestOptions]]]:
    """(its URL, the options the engine's own parser read from each body): answers one token, then finishes."""
    read: list[RequestOptions] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            read.append(parse_options(body))
            lines = [{"type": "token", "index": 0, "token_id": 4}, {"type": "finish", "index": 0}]
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"".join(json.dumps(line).encode() + b"\n" for line in lines))

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", read
    finally:
        server.shutdown()
        server.server_close()


def test_every_option_travels_from_a_remote_eval_to_the_engine() -> None:
    options = SamplingOptions(**EXAMPLES)
    with recording_deployment() as (url, read):
        answer = generate_one(url, [1, 2, 3], RemoteOptions(options, "adapter-a", frozenset({9})))
    assert answer["tokens"] == [4]
    assert read == [RequestOptions.of(options)]


def test_a_remote_eval_sends_the_eval_specs_decoding_settings() -> None:
    spec = EvalSpec.model_construct(
        eval_data_path="test.jsonl", max_new_tokens=12, temperature=0.7, top_k=3, top_p=0.0, seed=5, greedy=False
    )
    opts = RemoteOptions.of_spec(spec, frozenset())
    assert opts.request([1]).to_json() == {
        "max_tokens": 12,
        "temperature": 0.7,
        "top_k": 3,
        "seed": 5,
        "prompt_token_ids": [1],
    }
    with pytest.raises(BadInput) as err:  # serving samples at most at temperature 2
        RemoteOptions.of_spec(EvalSpec.model_construct(**{**spec.__dict__, "temperature": 5.0}), frozenset())
    assert err.value.field == "temperature"
    with pytest.raises(BadInput) as err:
        RemoteOptions.of_spec(EvalSpec.model_construct(**{**spec.__dict__, "max_new_tokens": 0}), frozenset())
    assert err.value.field == "max_new_tokens" and str(err.value).startswith("max_new_tokens: must be >= 1")


@pytest.mark.parametrize("name", OPTION_FIELDS)
def test_a_value_out_of_range_is_refused_by_name_in_all_three(name: str) -> None:
    with pytest.raises(RequestError) as err:
        SamplingOptions.from_json({name: OUT_OF_RANGE[name]})
    assert (err.value.field, err.value.code) == (name, "invalid_value")
    with pytest.raises(BadRequest) as engine:
        parse_request({"prompt": "hi", name: OUT_OF_RANGE[name]})
    assert (engine.value.field, engine.value.status) == (name, 400)
    chat_field = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}.get(name, name)
    with pytest.raises(OpenAIError) as api:
        chat_request({"model": "m", "messages": MESSAGES, **_openai(name, OUT_OF_RANGE[name], chat=True)})
    assert (api.value.status, api.value.param, api.value.code) == (400, chat_field, "invalid_value")
    assert api.value.message.startswith(f"{chat_field}: "), api.value.message


def test_every_request_field_has_a_wire_form_read_back_equal() -> None:
    request = ServeRequest(
        options=SamplingOptions(**EXAMPLES),
        messages=MESSAGES,
        model="adapter-a",
        structured={"regex": "[a-z]+"},
        tools=[{"type": "function", "function": {"name": "f"}}],
        chat_template_kwargs={"enable_thinking": False},
        stream=True,
    )
    wire = json.loads(json.dumps(request.to_json()))
    assert set(wire) == REQUEST_FIELDS - {"prompt", "prompt_token_ids"}
    assert ServeRequest.from_json(wire) == parse_request(wire) == request
    assert ServeRequest.from_json({**wire, "seed": None, "tools": None}) == dataclasses.replace(
        request, options=dataclasses.replace(request.options, seed=None), tools=None
    )  # JSON null reads as absent
    with pytest.raises(RequestError, match="^top_n: unknown field"):
        ServeRequest.from_json({**wire, "top_n": 1})
    with pytest.raises(RequestError) as err:
        ServeRequest.from_json({"prompt_token_ids": [1, -2]})
    assert (err.value.field, err.value.code) == ("prompt_token_ids", "invalid_type")
