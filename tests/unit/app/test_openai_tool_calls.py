"""Qwen3 tool calls on the OpenAI routes (``app.openai_tools``), through the official ``openai`` client.

Random weights never write a ``<tool_call>`` block of their own, so ``tool_choice: auto`` is checked against a scripted
engine: the stand-in answers with a fixed Qwen3 answer (a thought, then calls) cut into the real Qwen3 tokenizer's
tokens and detokenized by the engine's own ``Detokenizer``, so the text deltas split where a real engine's do. A named
or required ``tool_choice`` is checked on the real engine with random weights: the grammar alone makes the call."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from app.openai_format import ReasoningSplitter, chat_request
from app.openai_tools import ToolCallStream, split_tool_calls
from core_support import isolated_settings, make_token
from engine.serve.protocol import Detokenizer
from tests.security.openai_support import deploy, served
from tests.unit.serve_support import running_engine

ROOM = {
    "type": "object",
    "properties": {"room": {"enum": ["kitchen", "hall"]}, "volume": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["room", "volume"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "play", "description": "Play music", "parameters": ROOM}},
    {"type": "function", "function": {"name": "stop", "parameters": {"type": "object", "properties": {}}}},
]
MESSAGES = [{"role": "user", "content": "Play some jazz in the kitchen, please."}]
THOUGHT = "\nThe user wants music in the kitchen; I call play.\n"
CALLS = (
    '<tool_call>\n{"name": "play", "arguments": {"room": "kitchen", "volume": 4}}\n</tool_call>\n'
    '<tool_call>\n{"name": "stop", "arguments": {}}\n</tool_call>'
)
SCRIPT = f"<think>{THOUGHT}</think>\n\n{CALLS}"


# ------------------------------------------------------------------ the parsers on their own


@pytest.mark.parametrize(
    "text",
    [
        CALLS,
        f"Sure.\n\n{CALLS}\n",
        f"{CALLS}\n\nDone now.",
        "no calls here <tool_ but a tag's start\n",
        '<tool_call>\n{"name": broken}\n</tool_call> and text',
        "\nhello <tool_call>{unclosed",
        '<tool_call>{"name":"play","arguments":{"room" : "kitchen","volume":4} }</tool_call>',  # spacing as written
        '<tool_call>\n{"arguments": {}, "name": "stop"}\n</tool_call>',  # arguments first: sent when it closes
    ],
)
def test_streamed_tool_calls_add_up_to_the_whole_answers(text: str) -> None:
    want_content, want_calls = split_tool_calls(text)
    for size in (1, 2, 3, 7, len(text)):
        stream, content, deltas = ToolCallStream(), "", []
        for at in range(0, len(text), size):
            piece, more = stream.push(text[at : at + size])
            content, deltas = content + piece, deltas + more
        piece, more = stream.push("", final=True)
        content, deltas = content + piece, deltas + more
        assert content == want_content, (size, content)
        calls = _accumulate(deltas)
        assert [c["function"] for c in calls] == [c["function"] for c in want_calls]


def test_arguments_stream_as_they_are_written() -> None:
    stream, deltas, closed_at = ToolCallStream(), [], CALLS.index("</tool_call>")
    for at, char in enumerate(CALLS):
        deltas += [(at, d) for d in stream.push(char)[1]]
    pieces = [(at, d["function"]["arguments"]) for at, d in deltas if d["index"] == 0 and "name" not in d["function"]]
    assert len(pieces) > 5 and pieces[0][0] < closed_at  # piece by piece, before the block closes
    assert "".join(p for _, p in pieces) == '{"room": "kitchen", "volume": 4}'


def _accumulate(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call deltas joined by index, as the openai client's stream helpers join them."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"function": {"name": "", "arguments": ""}})
        call["function"]["name"] += d["function"].get("name") or ""
        call["function"]["arguments"] += d["function"].get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def test_a_stray_closing_think_tag_never_reaches_content() -> None:
    splitter, content = ReasoningSplitter(), ""
    for piece in ["the thought, opened by the template", "</th", "ink>\n\nthe answer"]:
        content += splitter.push(piece)[1]
    content += splitter.push("", final=True)[1]
    assert content == "the thought, opened by the template\n\nthe answer"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "dance"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
    ],
)
def test_bad_tools_and_formats_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai_error()) as err:
        chat_request({"model": "m", "messages": MESSAGES, **body})
    assert (err.value.status, err.value.param) == (400, param), err.value.message


def openai_error() -> type[Exception]:
    from app.openai_format import OpenAIError

    return OpenAIError


def test_tool_choice_none_shows_no_tools_and_a_named_one_forces_its_call() -> None:
    base = {"model": "m", "messages": MESSAGES, "tools": TOOLS}
    assert chat_request({**base, "tool_choice": "none"}).tools is None
    auto = chat_request(base)
    assert auto.tools == TOOLS and auto.structured is None
    named = chat_request({**base, "tool_choice": {"type": "function", "function": {"name": "play"}}}).structured
    assert named is not None and '"const": "play"' in named["lark"] and '"stop"' not in named["lark"]


# ------------------------------------------------------------------ a scripted engine behind the API


@contextmanager
def scripted_engine(tokenizer: Any, text: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(its URL, the bodies it received): answers every request with ``text`` token by token."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()
            detok = Detokenizer(tokenizer, ())
            lines: list[dict[str, Any]] = [{"type": "start", "prompt_tokens": 5}]
            lines += [{"type": "token", "index": 0, "token_id": t, "text": detok.push(t)} for t in ids]
            lines += [{"type": "token", "index": 0, "token_id": None, "text": detok.flush()}]
            lines += [{"type": "finish", "index": 0, "finish_reason": "stop", "completion_tokens": len(ids)}]
            usage = {"prompt_tokens": 5, "completion_tokens": len(ids), "total_tokens": 5 + len(ids)}
            lines += [{"type": "done", "usage": usage}]
            for line in lines:
                self.wfile.write(json.dumps(line).encode() + b"\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def scripted_api(tmp_path_factory, qwen_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    settings = isolated_settings(tmp_path_factory.mktemp("var"))
    with scripted_engine(tok, SCRIPT) as (url, bodies):
        deploy(settings, "alpha", "scripted", url)
        with served(settings) as (base, _):
            yield openai.OpenAI(base_url=f"{base}/v1", api_key=make_token(settings, "alpha"), max_retries=0), bodies


def test_streamed_tool_calls_after_a_thought(scripted_api) -> None:
    client, _ = scripted_api
    stream = client.chat.completions.create(model="scripted", messages=MESSAGES, tools=TOOLS, stream=True)
    reasoning, content, deltas, reasons = "", "", [], []
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta.model_dump()
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
            deltas += d.get("tool_calls") or []
            reasons += [choice.finish_reason] if choice.finish_reason else []
    assert reasoning == THOUGHT and content == "" and reasons == ["tool_calls"]
    assert all(d["id"] and d["function"]["arguments"] == "" for d in deltas if d["function"]["name"])
    calls = _accumulate(deltas)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("play", {"room": "kitchen", "volume": 4}),
        ("stop", {}),
    ]
    whole = client.chat.completions.create(model="scripted", messages=MESSAGES, tools=TOOLS)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == ""
    assert [c.function.arguments for c in message.tool_calls or []] == [c["function"]["arguments"] for c in calls]
    assert message.model_dump()["reasoning_content"] == THOUGHT


def test_tool_choice_none_parses_nothing(scripted_api) -> None:
    client, bodies = scripted_api
    answer = client.chat.completions.create(model="scripted", messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert "tools" not in bodies[-1] and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == "\n\n" + CALLS and not answer.choices[0].message.tool_calls


# ------------------------------------------------------------------ the real engine, random weights


@pytest.fixture(scope="module")
def real_api(tmp_path_factory, serve_model_dir, qwen_tokenizer_dir):
    spec = {"load": str(serve_model_dir), "tokenizer_name_or_path": str(qwen_tokenizer_dir), "max_num_seqs": 4}
    settings = isolated_settings(tmp_path_factory.mktemp("var"))
    with running_engine(tmp_path_factory.mktemp("run"), **spec, max_model_len=384, served_model_name="tiny") as (
        url,
        _,
    ):
        deploy(settings, "alpha", "tiny", url, load=str(serve_model_dir), tokenizer=str(qwen_tokenizer_dir))
        with served(settings) as (base, _):
            token = make_token(settings, "alpha")
            yield openai.OpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0), base, token


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_always_calls_it(real_api, stream: bool) -> None:
    client = real_api[0]
    choice = {"type": "function", "function": {"name": "play"}}
    kwargs = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "temperature": 1.0}
    kwargs |= {"seed": 3, "max_tokens": 80, "extra_body": NO_THINKING}
    if stream:
        deltas, reasons = [], []
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                deltas += c.delta.model_dump().get("tool_calls") or []
                reasons += [c.finish_reason] if c.finish_reason else []
        calls, reason = _accumulate(deltas), reasons[-1]
    else:
        answer = client.chat.completions.create(**kwargs).choices[0]
        calls, reason = [c.model_dump() for c in answer.message.tool_calls or []], answer.finish_reason
    assert reason == "tool_calls" and [c["function"]["name"] for c in calls] == ["play"], (
        answer if not stream else deltas
    )
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), ROOM)


def test_response_format_json_schema_on_the_real_engine(real_api) -> None:
    client = real_api[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "room", "schema": ROOM, "strict": True}}
    answer = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=fmt, n=3, seed=5, temperature=1.0, extra_body=NO_THINKING
    )
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), ROOM)
    choice_answer = client.completions.create(
        model="tiny", prompt="Pick:", extra_body={"structured_outputs": {"choice": ["red", "blue"]}}, max_tokens=5
    )
    assert choice_answer.choices[0].text in ("red", "blue")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "json_schema"})
    assert err.value.body["param"] == "response_format"
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=bad)
    assert err.value.body["param"] == "response_format" and "nonsense" in err.value.body["message"]


def test_tokenize_detokenize_and_metrics_through_the_api(real_api, qwen_tokenizer_dir) -> None:
    import httpx

    client, base, token = real_api
    client.completions.create(model="tiny", prompt="Hi", max_tokens=2)  # at least one request in the histograms
    auth = {"Authorization": f"Bearer {token}"}
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    r = httpx.post(f"{base}/tokenize", json={"model": "tiny", "prompt": "Hello world"}, headers=auth, timeout=30)
    assert r.json() == {"count": 2, "max_model_len": 384, "tokens": tok("Hello world")["input_ids"]}
    r = httpx.post(f"{base}/detokenize", json={"model": "tiny", "tokens": r.json()["tokens"]}, headers=auth)
    assert r.json() == {"prompt": "Hello world"}
    assert httpx.post(f"{base}/tokenize", json={"model": "tiny", "prompt": "x"}).status_code == 401
    r = httpx.post(f"{base}/tokenize", json={"model": "nope", "prompt": "x"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    text = httpx.get(f"{base}/v1/metrics", headers=auth, timeout=30).text
    assert 'vllm:num_requests_running{deployment="tiny",model_name="tiny"} 0.0' in text, text
    assert "vllm:time_to_first_token_seconds_bucket" in text and "vllm:kv_cache_usage_perc" in text
