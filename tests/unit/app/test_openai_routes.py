"""The OpenAI-compatible routes, driven by the official ``openai`` package: a team's ready deployment (a real engine,
``python -m engine serve``'s runner, on a tiny real-vocabulary Qwen3) streams transformers' greedy tokens; another
team gets 404, a deployment not ready 503, a full queue 429 with Retry-After, bad input 400; all in OpenAI's
error shape. The reasoning split and tool-call parsing are checked on their own."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer, Qwen3ForCausalLM

from app.main import create_app
from app.openai_format import ReasoningSplitter, split_tool_calls
from core.db import session_scope
from core.jobs import create_job
from core.models import Event, Job
from core_support import isolated_settings, make_token
from engine.contract.spec import parse_spec
from tests.unit.serve_support import running_engine

MESSAGES = [{"role": "user", "content": "Play some jazz in the kitchen, please."}]


@pytest.fixture(scope="module")
def engine_url(serve_model_dir, qwen_tokenizer_dir, tmp_path_factory):
    spec = {"load": str(serve_model_dir), "tokenizer_name_or_path": str(qwen_tokenizer_dir), "max_num_seqs": 2}
    with running_engine(tmp_path_factory.mktemp("run"), **spec, max_model_len=128) as (url, _):
        yield url


@pytest.fixture(scope="module")
def service(tmp_path_factory, engine_url, serve_model_dir, qwen_tokenizer_dir):
    settings = isolated_settings(tmp_path_factory.mktemp("var"))

    def deploy(team: str, name: str, url: str | None, state: str = "running") -> None:
        raw = {"kind": "serve", "load": str(serve_model_dir), "served_model_name": name}
        raw["tokenizer_name_or_path"] = str(qwen_tokenizer_dir)
        with session_scope(settings.database_url) as session:
            job, _ = create_job(session, settings=settings, team=team, spec=parse_spec(raw), raw=raw)
            session.query(Job).filter(Job.id == job.id).update({"state": state, "attempt_count": 1})
            if url:
                session.add(Event(job_id=job.id, attempt=1, type="ready", data={"url": url}))

    deploy("alpha", "tiny-chat", engine_url)
    deploy("alpha", "warming-up", None, state="starting")
    deploy("beta", "beta-model", engine_url)
    with TestClient(create_app(settings, reconcile=False)) as http:
        yield http, make_token(settings, "alpha")


def _client(service) -> openai.OpenAI:
    http, token = service
    return openai.OpenAI(base_url="http://testserver/v1", api_key=token, http_client=http, max_retries=0)


def _hf_greedy(serve_model_dir: Path, tokenizer_dir: Path, max_new: int) -> tuple[list[int], str]:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    hf = Qwen3ForCausalLM.from_pretrained(serve_model_dir, dtype=torch.float32).eval()
    stop = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=stop)
    new = [t for t in out[0, len(ids) :].tolist() if t not in stop]
    return new, tok.decode(new, skip_special_tokens=True)


def test_models_lists_the_teams_ready_deployments(service) -> None:
    assert [m.id for m in _client(service).models.list()] == ["tiny-chat"]


def test_streamed_chat_equals_transformers_greedy(service, serve_model_dir, qwen_tokenizer_dir) -> None:
    tokens, text = _hf_greedy(serve_model_dir, qwen_tokenizer_dir, 16)
    stream = _client(service).chat.completions.create(
        model="tiny-chat",
        messages=MESSAGES,
        stream=True,
        temperature=0,
        max_tokens=16,
        logprobs=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    logprob_tokens = [
        lp.token for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content
    ]
    assert len(logprob_tokens) == len(tokens) + (len(tokens) < 16)  # the stop token is generated too
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(logprob_tokens)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_whole_chat_and_text_completions(service, serve_model_dir, qwen_tokenizer_dir) -> None:
    client = _client(service)
    _, text = _hf_greedy(serve_model_dir, qwen_tokenizer_dir, 16)
    answer = client.chat.completions.create(
        model="tiny-chat",
        messages=MESSAGES,
        temperature=0,
        max_tokens=16,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert answer.choices[0].message.content == text
    assert (
        answer.usage.prompt_tokens > 0
        and answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    )
    done = client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=5, temperature=0, n=2, seed=3)
    assert [c.index for c in done.choices] == [0, 1] and done.choices[0].text == done.choices[1].text
    streamed = client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text


def test_errors_in_openai_shape(service, engine_url) -> None:
    client = _client(service)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="beta-model", messages=MESSAGES)  # another team's
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    with pytest.raises(openai.InternalServerError) as warming:
        client.chat.completions.create(model="warming-up", messages=MESSAGES)
    assert warming.value.status_code == 503 and warming.value.response.headers["Retry-After"] == "5"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny-chat", messages=MESSAGES, temperature=7)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=service[0]).models.list()


def test_full_queue_is_429_with_retry_after(service, monkeypatch) -> None:
    from engine.serve.batcher import Batcher, QueueFull

    def full(self, seqs):
        raise QueueFull(retry_after=2.0)

    monkeypatch.setattr(Batcher, "submit", full)  # the engine runs in this process: make its queue refuse
    with pytest.raises(openai.RateLimitError) as err:
        _client(service).chat.completions.create(model="tiny-chat", messages=MESSAGES)
    assert err.value.response.headers["Retry-After"] == "2" and err.value.body["code"] == "queue_full"


def test_reasoning_split_streams_and_whole() -> None:
    text = "<think>\nweigh it\n</think>\n\nyes"
    assert ReasoningSplitter().push(text, final=True) == ("\nweigh it\n", "\n\nyes")
    splitter, parts = ReasoningSplitter(), []
    for piece in ["<th", "ink>\nweigh", " it\n</th", "ink>\n\n", "yes"]:
        parts.append(splitter.push(piece))
    parts.append(splitter.push("", final=True))
    assert "".join(r for r, _ in parts) == "\nweigh it\n" and "".join(c for _, c in parts) == "\n\nyes"
    assert ReasoningSplitter().push("plain", final=True) == ("", "plain")


def test_tool_calls_are_parsed() -> None:
    content, calls = split_tool_calls(
        'ok <tool_call>\n{"name": "play", "arguments": {"room": "kitchen"}}\n</tool_call>'
    )
    assert content == "ok" and calls[0]["function"] == {"name": "play", "arguments": '{"room": "kitchen"}'}
    assert split_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def test_an_eval_names_a_ready_deployment_of_its_team(service, engine_url, qwen_tokenizer_dir) -> None:
    """Issue 24 item 6: an eval spec may name a ready deployment instead of a checkpoint: accepted with the
    deployment's tokenizer; one not ready, or another team's, is a 422 naming ``deployment``; at launch the worker
    hands the engine the deployment's current URL (``deployment_url``)."""
    from core.deployments import with_deployment_url
    from core.paths import team_area

    http, token = service
    settings = http.app.state.settings
    area = team_area(settings, "alpha", settings.data_roots[0])
    area.mkdir(parents=True, exist_ok=True)
    (area / "test.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]}\n'
    )
    body = {"kind": "eval", "deployment": "tiny-chat", "eval_data_path": "test.jsonl", "max_new_tokens": 4}
    headers = {"Authorization": f"Bearer {token}"}
    accepted = http.post("/v1/jobs", json=body, headers=headers)
    assert accepted.status_code == 201, accepted.text
    spec = accepted.json()["spec"]
    assert spec["tokenizer_name_or_path"] == str(qwen_tokenizer_dir) and spec.get("load") is None
    launched = with_deployment_url(settings, "alpha", spec)
    assert launched["deployment_url"] == engine_url and launched["deployment"] == "tiny-chat"
    for name, why in (("warming-up", "not ready"), ("beta-model", "no deployment")):
        refused = http.post("/v1/jobs", json={**body, "deployment": name}, headers=headers)
        assert refused.status_code == 422 and refused.json()["field"] == "deployment", refused.text
        assert why in refused.json()["message"]
    both = http.post("/v1/jobs", json={**body, "load": "somewhere"}, headers=headers)
    assert both.status_code == 422 and both.json()["field"] == "deployment", both.text
    aimed = {**body, "deployment": None, "deployment_url": "http://169.254.169.254/"}  # workers never POST where told
    refused = http.post("/v1/jobs", json=aimed, headers=headers)
    assert refused.status_code == 422 and refused.json()["field"] == "deployment_url", refused.text


def test_remembered_token_and_deployment_follow_revokes_and_stops(
    service, engine_url, serve_model_dir, qwen_tokenizer_dir, monkeypatch
) -> None:
    """``app.lookup_cache``: a request's principal and deployment are remembered, yet a cancel or a revoke made in
    this process is seen by the very next request; another process's revoke (a write no session of this process
    makes) once the remembered entry expired."""
    from sqlalchemy import update

    from app import lookup_cache
    from core.auth import Principal, hash_token, revoke_token
    from core.db import get_engine
    from core.models import ApiToken

    monkeypatch.setattr(lookup_cache.PRINCIPALS, "ttl_s", 60.0)  # nothing expires by itself on a slow machine
    monkeypatch.setattr(lookup_cache.DEPLOYMENTS, "ttl_s", 60.0)
    http, _ = service
    settings = http.app.state.settings
    raw = {"kind": "serve", "load": str(serve_model_dir), "served_model_name": "cached-chat"}
    raw["tokenizer_name_or_path"] = str(qwen_tokenizer_dir)
    with session_scope(settings.database_url) as session:
        job, _ = create_job(session, settings=settings, team="alpha", spec=parse_spec(raw), raw=raw)
        session.query(Job).filter(Job.id == job.id).update({"state": "running", "attempt_count": 1})
        session.add(Event(job_id=job.id, attempt=1, type="ready", data={"url": engine_url}))
    token = make_token(settings, "alpha")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=token, http_client=http, max_retries=0)

    def ask() -> object:
        return client.chat.completions.create(model="cached-chat", messages=MESSAGES, max_tokens=2, temperature=0)

    ask()
    alpha = Principal(team="alpha", admin=False, token_id=0)
    assert lookup_cache.DEPLOYMENTS.get(lookup_cache.deployment_key(settings.database_url, alpha, "cached-chat"))
    assert lookup_cache.PRINCIPALS.get(lookup_cache.principal_key(settings.database_url, token))
    assert http.post(f"/v1/jobs/{job.id}/cancel", headers={"Authorization": f"Bearer {token}"}).status_code == 202
    with pytest.raises(openai.InternalServerError) as stopping:  # its engine still answers: not served all the same
        ask()
    assert stopping.value.status_code == 503 and "cancelling" in stopping.value.message
    with session_scope(settings.database_url) as session:
        assert revoke_token(session, token) == 1
    with pytest.raises(openai.AuthenticationError):
        client.models.list()

    other = make_token(settings, "alpha")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=other, http_client=http, max_retries=0)
    client.models.list()
    with get_engine(settings.database_url).begin() as conn:  # as `token revoke` writes it from another process
        conn.execute(
            update(ApiToken).where(ApiToken.token_hash == hash_token(other)).values(revoked_at=ApiToken.created_at)
        )
    client.models.list()  # still remembered: another process's revoke is bounded by the TTL alone
    monkeypatch.setattr(lookup_cache.PRINCIPALS, "ttl_s", 0.0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
