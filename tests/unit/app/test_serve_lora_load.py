"""LoRA adapters loaded into and unloaded from a running deployment through the API (vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``): listed in ``GET /v1/models`` at once and answering under
their name with transformers' greedy tokens on the merged weights; gone after the unload; the path checked as at
submission (inside the team's areas), names unique in the team (409), another team's deployment and adapters missing
(404)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from app.main import create_app
from core.db import session_scope
from core.jobs import create_job
from core.models import Event, Job
from core_support import auth, isolated_settings, make_token, team_dir
from engine.contract.spec import parse_spec
from tests.unit.serve_support import merged_hf_model, running_engine, write_lora_checkpoint

MESSAGES = [{"role": "user", "content": "Play some jazz in the kitchen, please."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@dataclass
class Service:
    http: TestClient
    alpha: dict[str, str]  # the deployment's team's headers
    beta: dict[str, str]  # another team's
    client: openai.OpenAI
    model_dir: Path
    jazz: Path  # a LoRA checkpoint in alpha's area
    outside: Path  # one outside it


@pytest.fixture(scope="module")
def service(tmp_path_factory, serve_model_dir, qwen_tokenizer_dir) -> Iterator[Service]:
    settings = isolated_settings(tmp_path_factory.mktemp("var"))
    area = team_dir(settings, "alpha")
    model_dir = Path(shutil.copytree(serve_model_dir, area / "base"))
    tok_dir = Path(shutil.copytree(qwen_tokenizer_dir, area / "tokenizer"))
    jazz = write_lora_checkpoint(model_dir, area / "jazz", 1, 4, 8.0, ["linear_qkv", "linear_fc2"])
    outside = write_lora_checkpoint(
        model_dir, tmp_path_factory.mktemp("elsewhere") / "news", 2, 2, 4.0, ["linear_proj"]
    )
    raw = {
        "kind": "serve",
        "load": str(model_dir),
        "tokenizer_name_or_path": str(tok_dir),
        "served_model_name": "tiny-base",
        "max_num_seqs": 2,
        "max_model_len": 128,
    }
    with running_engine(tmp_path_factory.mktemp("run"), **{k: v for k, v in raw.items() if k != "kind"}) as (url, _):
        with session_scope(settings.database_url) as session:
            job, _ = create_job(session, settings=settings, team="alpha", spec=parse_spec(raw), raw=raw)
            session.query(Job).filter(Job.id == job.id).update({"state": "running", "attempt_count": 1})
            session.add(Event(job_id=job.id, attempt=1, type="ready", data={"url": url}))
        with TestClient(create_app(settings, reconcile=False)) as http:
            alpha = make_token(settings, "alpha")
            client = openai.OpenAI(base_url="http://testserver/v1", api_key=alpha, http_client=http, max_retries=0)
            yield Service(http, auth(alpha), auth(make_token(settings, "beta")), client, model_dir, jazz, outside)


def _greedy(service: Service, model: str) -> str:
    out = service.client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=12, extra_body=NO_THINKING
    )
    return out.choices[0].message.content or ""


def _expected(model_dir: Path, lora: Path) -> str:
    import torch

    hf, tok = merged_hf_model(model_dir, lora), AutoTokenizer.from_pretrained(str(model_dir.parent / "tokenizer"))
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    stop = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=stop)
    return tok.decode([t for t in out[0, len(ids) :].tolist() if t not in stop], skip_special_tokens=True)


def _load(service: Service, headers: dict[str, str], **body: object):
    return service.http.post("/v1/load_lora_adapter", json=body, headers=headers)


def test_a_loaded_adapter_is_listed_answers_and_goes_when_unloaded(service) -> None:
    base = _greedy(service, "tiny-base")
    answer = _load(service, service.alpha, lora_name="jazz-lora", lora_path=str(service.jazz))
    assert answer.status_code == 200 and "jazz-lora" in answer.text, answer.text
    models = {m.id: m for m in service.client.models.list()}
    assert models["jazz-lora"].model_dump()["parent"] == "tiny-base"
    jazz = _greedy(service, "jazz-lora")
    assert jazz == _expected(service.model_dir, service.jazz) and jazz != base
    assert _greedy(service, "tiny-base") == base  # the base is untouched

    again = _load(service, service.alpha, lora_name="jazz-lora", lora_path=str(service.jazz))
    assert again.status_code == 409 and again.json()["error"]["param"] == "lora_name"
    theirs = service.http.post("/v1/unload_lora_adapter", json={"lora_name": "jazz-lora"}, headers=service.beta)
    assert theirs.status_code == 404  # another team's adapter reads as missing

    gone = service.http.post("/v1/unload_lora_adapter", json={"lora_name": "jazz-lora"}, headers=service.alpha)
    assert gone.status_code == 200, gone.text
    assert "jazz-lora" not in {m.id for m in service.client.models.list()}
    with pytest.raises(openai.NotFoundError):
        _greedy(service, "jazz-lora")
    assert _greedy(service, "tiny-base") == base
    # the name is free again: the same checkpoint loads under it once more
    assert _load(service, service.alpha, lora_name="jazz-lora", lora_path=str(service.jazz)).status_code == 200
    assert _greedy(service, "jazz-lora") == jazz
    assert (
        service.http.post("/v1/unload_lora_adapter", json={"lora_name": "jazz-lora"}, headers=service.alpha).status_code
        == 200
    )


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"lora_name": "news", "lora_path": "OUTSIDE"}, 400, "lora_path"),  # outside the team's areas
        ({"lora_name": "news", "lora_path": "BASE"}, 400, "lora_path"),  # a model, not a LoRA checkpoint
        ({"lora_name": "tiny-base", "lora_path": "JAZZ"}, 409, "lora_name"),  # the deployment's own name
        ({"lora_name": "", "lora_path": "JAZZ"}, 400, "lora_name"),
        ({"lora_name": "x", "lora_path": "JAZZ", "lora_int_id": 3}, 400, "lora_int_id"),
        ({"lora_name": "x", "lora_path": "JAZZ", "model": "nope"}, 404, "model"),
    ],
)
def test_refusals_name_the_field(service, body, status, param) -> None:
    paths = {"OUTSIDE": str(service.outside), "BASE": str(service.model_dir), "JAZZ": str(service.jazz)}
    body = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    answer = _load(service, service.alpha, **body)
    assert answer.status_code == status and answer.json()["error"]["param"] == param, answer.text
    assert {m.id for m in service.client.models.list()} == {"tiny-base"}


def test_another_team_cannot_load_into_the_deployment(service) -> None:
    answer = _load(service, service.beta, lora_name="x", lora_path=str(service.jazz), model="tiny-base")
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model"
