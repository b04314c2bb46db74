"""``llmjobs chat`` against the in-process API and a real engine (``python -m engine serve``'s runner on a tiny
real-vocabulary Qwen3): two turns from stdin, streamed: the first equal to transformers' greedy answer, each equal to what the
``openai`` package gets for the whole conversation so far (system prompt, history, thinking off, greedy);
``/exit`` ends it; an unknown deployment is an error
naming the code, exit 1."""

from __future__ import annotations

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer, Qwen3ForCausalLM
from typer.testing import CliRunner

from app.main import create_app
from cli import remote
from cli.main import cli
from core.db import session_scope
from core.jobs import create_job
from core.models import Event, Job
from core_support import auth, isolated_settings, make_token
from engine.contract.spec import parse_spec
from llmjobs import Client
from tests.unit.serve_support import running_engine

SYSTEM = "Answer briefly."


@pytest.fixture(scope="module")
def api(tmp_path_factory, serve_model_dir, qwen_tokenizer_dir):
    raw = {"load": str(serve_model_dir), "tokenizer_name_or_path": str(qwen_tokenizer_dir), "max_model_len": 256}
    settings = isolated_settings(tmp_path_factory.mktemp("var"))
    with running_engine(tmp_path_factory.mktemp("run"), **raw, max_num_seqs=2) as (url, _):
        spec = {"kind": "serve", **raw, "served_model_name": "tiny-chat"}
        with session_scope(settings.database_url) as session:
            job, _ = create_job(session, settings=settings, team="alpha", spec=parse_spec(spec), raw=spec)
            session.query(Job).filter(Job.id == job.id).update({"state": "running", "attempt_count": 1})
            session.add(Event(job_id=job.id, attempt=1, type="ready", data={"url": url}))
        with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as http:
            yield http


@pytest.fixture
def client(api, monkeypatch):
    monkeypatch.setattr(remote, "Client", lambda: Client(http=api))


def _api_answer(api, messages: list[dict[str, str]]) -> str:
    token = api.headers["Authorization"].split()[1]
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=token, http_client=api, max_retries=0)
    answer = client.chat.completions.create(
        model="tiny-chat",
        messages=messages,
        temperature=0,
        max_tokens=10,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    return answer.choices[0].message.content or ""


def _greedy_answer(model_dir, tokenizer_dir, messages: list[dict[str, str]]) -> str:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stop = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=stop)
    return tok.decode([t for t in out[0, len(ids) :].tolist() if t not in stop], skip_special_tokens=True)


def test_two_turns_stream_the_greedy_answers_to_the_whole_conversation(
    api, client, serve_model_dir, qwen_tokenizer_dir
) -> None:
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Play some jazz."}]
    first = _api_answer(api, history)
    assert first == _greedy_answer(serve_model_dir, qwen_tokenizer_dir, history)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "Louder!"}]
    second = _api_answer(api, history)
    assert second != _api_answer(api, history[-1:])  # the history changes the answer
    args = ["chat", "tiny-chat", "--system", SYSTEM, "--no-thinking", "--temperature", "0", "--max-tokens", "10"]
    result = CliRunner().invoke(cli, args, input="Play some jazz.\n\nLouder!\n/exit\nnever sent\n")
    assert result.exit_code == 0, result.output
    assert result.output == f"{first}\n{second}\n".replace("\r\n", "\n")  # CliRunner's output reads \r\n as \n


def test_unknown_deployment_is_an_error(client) -> None:
    result = CliRunner().invoke(cli, ["chat", "no-such-model"], input="hi\n")
    assert result.exit_code == 1
    assert "HTTP 404 model_not_found" in result.output
