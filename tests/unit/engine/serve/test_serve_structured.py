"""Structured output, ``/tokenize`` / ``/detokenize`` and the vLLM-named ``/metrics`` of a real engine (the tiny
random-weight Qwen3 with the real vocabulary): with random weights only the grammar's mask can make the answer valid,
so every answer that ends parses and validates; a bad grammar is a 400 naming ``structured``."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from engine.serve.structured import Grammars, StructuredError, grammar_of
from tests.unit.serve_support import running_engine

MESSAGES = [{"role": "user", "content": "Play some jazz in the kitchen, please."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "room": {"enum": ["kitchen", "hall", "attic"]},
        "volume": {"type": "integer", "minimum": 0, "maximum": 10},
        "on": {"type": "boolean"},
        "genre": {"type": "string", "maxLength": 6},
    },
    "required": ["room", "volume", "on", "genre"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(serve_model_dir, qwen_tokenizer_dir, tmp_path_factory):
    spec = {"load": str(serve_model_dir), "tokenizer_name_or_path": str(qwen_tokenizer_dir), "max_num_seqs": 4}
    with running_engine(tmp_path_factory.mktemp("run"), **spec, max_model_len=256, served_model_name="tiny") as (
        url,
        _,
    ):
        yield url


def _generate(url: str, body: dict) -> tuple[list[str], list[str]]:
    """(each choice's text, each choice's finish_reason)."""
    with httpx.stream("POST", f"{url}/v1/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [json.loads(x) for x in r.iter_lines() if x]
    n = body.get("n", 1)
    texts, reasons = [""] * n, [""] * n
    for line in lines:
        if line["type"] == "token":
            texts[line["index"]] += line["text"]
        elif line["type"] == "finish":
            reasons[line["index"]] = line["finish_reason"]
    return texts, reasons


def test_a_json_schema_answer_always_parses_and_validates(engine) -> None:
    body = {
        "messages": MESSAGES,
        "chat_template_kwargs": {"enable_thinking": False},
        "structured": {"json_schema": SCHEMA},
        "temperature": 1.0,
        "seed": 7,
        "n": 4,
        "max_tokens": 120,
    }
    texts, reasons = _generate(engine, body)
    assert reasons == ["stop"] * 4, texts
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_with_thinking_the_grammar_starts_after_the_thought(qwen_tokenizer_dir) -> None:
    """Scripted tokens (random weights think forever once they open ``<think>``): the first token may open a thought,
    which is free; from the token after ``</think>`` only the grammar's tokens are allowed."""
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    constraint = Grammars(tok, 151936, end).constraint(grammar_of({"choice": ["yes"]}), thinking=True)
    think, close, brace = tok.convert_tokens_to_ids(["<think>", "</think>", "{"])
    yes = tok("yes", add_special_tokens=False)["input_ids"]

    def allowed() -> set[int]:
        return set(torch.nonzero(constraint.mask(torch.zeros(151936)).isfinite()).flatten().tolist())

    assert allowed() == {think, yes[0]}
    constraint.advance(think)
    for token in [brace, *tok("free thought", add_special_tokens=False)["input_ids"], close]:
        assert len(allowed()) == 151936  # a thought is free, its closing tag included
        constraint.advance(token)
    assert allowed() == {yes[0]}
    constraint.advance(yes[0])
    assert allowed() == {end}


def test_choice_and_regex(engine) -> None:
    choices = ["yes", 'no "way"', "maybe\nlater"]
    texts, _ = _generate(engine, {"prompt": "Answer:", "structured": {"choice": choices}, "n": 3, "seed": 1})
    assert all(t in choices for t in texts), texts
    texts, _ = _generate(
        engine, {"prompt": "Date:", "structured": {"regex": r"20[0-9]{2}-[01][0-9]"}, "n": 3, "seed": 2}
    )
    assert all(re.fullmatch(r"20[0-9]{2}-[01][0-9]", t) for t in texts), texts


@pytest.mark.parametrize(
    ("structured", "says"),
    [
        ({"json_schema": {"type": "nonsense"}}, "structured.json_schema"),
        ({"regex": "[a-"}, "structured.regex"),
        ({"choice": []}, "structured.choice"),
        ({"json_schema": {}, "regex": "a"}, "structured: must be"),
        ("json", "structured: must be"),
    ],
)
def test_a_bad_grammar_is_a_400_naming_structured(engine, structured, says) -> None:
    r = httpx.post(f"{engine}/v1/generate", json={"prompt": "hi", "structured": structured}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "structured", r.text
    assert r.json()["error"]["message"].startswith(says)
    with pytest.raises(StructuredError):
        grammar_of(structured)


def test_tokenize_and_detokenize(engine, qwen_tokenizer_dir) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    chat = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    r = httpx.post(f"{engine}/tokenize", json=chat, timeout=30)
    want = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    assert r.status_code == 200 and r.json() == {"count": len(want), "max_model_len": 256, "tokens": want}
    r = httpx.post(f"{engine}/tokenize", json={"prompt": "Hello world"}, timeout=30)
    assert r.json()["tokens"] == tok("Hello world")["input_ids"]
    r = httpx.post(f"{engine}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30)
    assert r.json() == {"prompt": "Hello world"}
    for path, body, field in [
        ("/tokenize", {"prompt": "x", "max_tokens": 3}, "max_tokens"),
        ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ]:
        r = httpx.post(f"{engine}{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text


def test_metrics_have_vllms_names_and_labels(engine) -> None:
    _generate(engine, {"prompt": "Hi", "max_tokens": 3, "temperature": 0})
    text = httpx.get(f"{engine}/metrics", timeout=30).text
    labels = '{deployment="tiny",model_name="tiny"}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"{name}{labels} 0.0" in text, text
    assert "vllm:prefix_cache_hits_total" in text and "vllm:prefix_cache_queries_total" in text
    count = re.search(r"vllm:time_to_first_token_seconds_count\{[^}]*model_name=\"tiny\"\} (\S+)", text)
    assert count and float(count.group(1)) >= 1, text
    assert re.search(r"vllm:generation_tokens_total\{[^}]*\} [1-9]", text)
    assert 'vllm:request_success_total{deployment="tiny",finished_reason="length",model_name="tiny"}' in text
