"""Several LoRA adapters on one base through the OpenAI routes (vLLM's multi-LoRA serving): a serve job with
``lora_adapters`` (two LoRA checkpoints as our train jobs save them) lists its base and adapters in ``GET /v1/models``
with ``parent`` / ``root``; each adapter answers under its own name with the greedy tokens of transformers on the
base with that adapter merged, the base with the base's; an unknown name is an OpenAI-shaped 404."""

from __future__ import annotations

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from app.main import create_app
from core.db import session_scope
from core.jobs import create_job
from core.models import Event, Job
from core_support import isolated_settings, make_token
from engine.contract.spec import parse_spec
from tests.unit.serve_support import merged_hf_model, running_engine, write_lora_checkpoint

MESSAGES = [{"role": "user", "content": "Play some jazz in the kitchen, please."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def adapters(serve_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    one = write_lora_checkpoint(serve_model_dir, root / "jazz", 1, 4, 8.0, ["linear_qkv", "linear_fc2"])
    two = write_lora_checkpoint(serve_model_dir, root / "news", 2, 2, 4.0, ["linear_proj", "linear_fc1"])
    return {"jazz-lora": str(one), "news-lora": str(two)}


@pytest.fixture(scope="module")
def service(tmp_path_factory, serve_model_dir, qwen_tokenizer_dir, adapters):
    raw = {
        "kind": "serve",
        "load": str(serve_model_dir),
        "tokenizer_name_or_path": str(qwen_tokenizer_dir),
        "served_model_name": "tiny-base",
        "lora_adapters": adapters,
        "max_num_seqs": 4,
        "max_model_len": 128,
    }
    settings = isolated_settings(tmp_path_factory.mktemp("var"))
    spec = parse_spec(raw)
    with running_engine(tmp_path_factory.mktemp("run"), **{k: v for k, v in raw.items() if k != "kind"}) as (url, _):
        with session_scope(settings.database_url) as session:
            job, _ = create_job(session, settings=settings, team="alpha", spec=spec, raw=raw)
            session.query(Job).filter(Job.id == job.id).update({"state": "running", "attempt_count": 1})
            session.add(Event(job_id=job.id, attempt=1, type="ready", data={"url": url}))
        with TestClient(create_app(settings, reconcile=False)) as http:
            yield openai.OpenAI(
                base_url="http://testserver/v1", api_key=make_token(settings, "alpha"), http_client=http, max_retries=0
            )


def _expected(hf, tokenizer_dir) -> str:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    stop = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=stop)
    return tok.decode([t for t in out[0, len(ids) :].tolist() if t not in stop], skip_special_tokens=True)


def test_models_lists_the_base_and_its_adapters(service, serve_model_dir, adapters) -> None:
    models = {m.id: m.model_dump() for m in service.models.list()}
    assert list(models) == ["tiny-base", "jazz-lora", "news-lora"]
    assert models["tiny-base"]["parent"] is None and models["tiny-base"]["root"] == str(serve_model_dir)
    for name, path in adapters.items():
        assert models[name]["parent"] == "tiny-base" and models[name]["root"] == path


def test_each_adapter_answers_under_its_name_with_its_own_greedy_tokens(
    service, serve_model_dir, qwen_tokenizer_dir, adapters
) -> None:
    from transformers import Qwen3ForCausalLM

    expected = {"tiny-base": _expected(Qwen3ForCausalLM.from_pretrained(serve_model_dir).eval(), qwen_tokenizer_dir)}
    for name, path in adapters.items():
        expected[name] = _expected(merged_hf_model(serve_model_dir, path), qwen_tokenizer_dir)
    assert len(set(expected.values())) == 3  # the adapters change the answer
    for model, text in expected.items():
        stream = service.chat.completions.create(
            model=model, messages=MESSAGES, stream=True, temperature=0, max_tokens=12, extra_body=NO_THINKING
        )
        chunks = list(stream)
        assert {c.model for c in chunks} == {model}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text, model


def test_unknown_model_is_an_openai_404(service) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        service.chat.completions.create(model="sports-lora", messages=MESSAGES, max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
