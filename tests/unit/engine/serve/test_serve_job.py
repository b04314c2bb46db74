"""``python -m engine serve``'s runner end to end in one process: a tiny real-vocabulary Qwen3 written by transformers,
the real Qwen3 tokenizer; the endpoint's URL is reported in ``serve.json`` and the ``ready`` event, and its JSON-lines
stream carries transformers' greedy tokens; bad requests are 400 naming the field; idle_timeout_s ends the job."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from engine.contract.runfiles import RunDir
from engine.contract.spec import ServeSpec
from engine.serve.job import run
from tests.unit.serve_support import running_engine


@pytest.fixture(scope="module")
def deployment(serve_model_dir, qwen_tokenizer_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    spec = {"load": str(serve_model_dir), "tokenizer_name_or_path": str(qwen_tokenizer_dir), "max_num_seqs": 4}
    with running_engine(run_dir, **spec, max_model_len=128) as (url, summary):
        # one answered request of the fixture's own: under xdist and a random order, the tests this process runs may
        # all be refusals (not counted), and the summary's count must not depend on which tests those are
        _lines(url, {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        yield url, RunDir(run_dir)
    assert summary["requests"] >= 1


def _lines(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def _hf_greedy(serve_model_dir: Path, ids: list[int], max_new: int, stop: list[int]) -> list[int]:
    hf = Qwen3ForCausalLM.from_pretrained(serve_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=stop)
    return out[0, len(ids) :].tolist()


def test_ready_event_names_the_url(deployment) -> None:
    url, rundir = deployment
    events = [json.loads(x) for x in (rundir.path / "events.jsonl").read_text().splitlines()]
    ready = [e for e in events if e["type"] == "ready"]
    assert ready and ready[0]["data"]["url"] == url
    assert httpx.get(f"{url}/health").json()["status"] == "ready"


def test_chat_stream_equals_transformers_greedy(deployment, serve_model_dir, qwen_tokenizer_dir) -> None:
    url, _ = deployment
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    messages = [{"role": "user", "content": "Play some jazz in the kitchen, please."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    stop = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    expected = _hf_greedy(serve_model_dir, ids, 16, stop)
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 16}
    lines = _lines(url, {**body, "temperature": 0})
    assert lines[0] == {"type": "start", "prompt_tokens": len(ids)}
    tokens = [x["token_id"] for x in lines if x["type"] == "token" and x["token_id"] is not None]
    assert tokens == expected
    text = "".join(x["text"] for x in lines if x["type"] == "token")
    assert text == tok.decode(expected, skip_special_tokens=True)
    assert lines[-1]["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": len(expected),
        "total_tokens": len(ids) + len(expected),
    }


def test_concurrent_requests_each_get_their_own_greedy_tokens(deployment, serve_model_dir) -> None:
    url, _ = deployment
    prompts = [
        [9707, 11, 1879, 0],
        [785, 3974, 13876, 38835, 34208, 916],
        [40, 1079],
        [3838, 374, 220, 17, 10, 17, 30],
        [2132],
    ]
    expected = [_hf_greedy(serve_model_dir, p, 8, [151645]) for p in prompts]
    got: list[list[int]] = [[] for _ in prompts]

    def one(i: int) -> None:
        lines = _lines(url, {"prompt_token_ids": prompts[i], "max_tokens": 8, "temperature": 0})
        got[i] = [x["token_id"] for x in lines if x["type"] == "token" and x["token_id"] is not None]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]  # 5 requests, 4 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


def test_stop_string_and_n(deployment) -> None:
    url, _ = deployment
    free = _lines(url, {"prompt": "Hello", "max_tokens": 12, "temperature": 0})
    text = "".join(x["text"] for x in free if x["type"] == "token")
    assert len(text) > 4
    cut = _lines(url, {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "stop": [text[2:4]]})
    finish = [x for x in cut if x["type"] == "finish"]
    assert "".join(x["text"] for x in cut if x["type"] == "token") == text[: text.find(text[2:4])]
    assert finish[0]["finish_reason"] == "stop"
    two = _lines(url, {"prompt": "Hello", "max_tokens": 4, "temperature": 1.0, "seed": 1, "n": 2, "logprobs": 2})
    assert sorted(x["index"] for x in two if x["type"] == "finish") == [0, 1]
    assert all(len(x["top_logprobs"]) == 2 for x in two if x["type"] == "token" and x["token_id"] is not None)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "hi", "temperature": 5}, "temperature"),
        ({"prompt": "hi", "max_tokens": 1000}, "max_tokens"),
        ({"prompt": "hi", "bogus": 1}, "bogus"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
        ({"prompt_token_ids": [10**9]}, "prompt_token_ids"),
    ],
)
def test_bad_requests_name_the_field(deployment, body, field) -> None:
    url, _ = deployment
    r = httpx.post(f"{url}/v1/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text


def test_idle_timeout_ends_the_job(serve_model_dir, qwen_tokenizer_dir, tmp_path) -> None:
    spec = ServeSpec(
        load=str(serve_model_dir),
        tokenizer_name_or_path=str(qwen_tokenizer_dir),
        max_num_seqs=1,
        max_model_len=32,
        idle_timeout_s=0.5,
    )
    outputs, summary = run(spec, RunDir(tmp_path))
    assert summary["requests"] == 0 and outputs["result"].endswith("result.json")
