"""A ``serve`` job through the service as a user runs it (`llmjobs serve`, its worker launching ``python -m engine
serve``): it becomes ready, the ``openai`` package streams transformers' greedy tokens from it, its deployment
metrics reach the metrics API, another team gets 404, and a cancel takes the deployment off ``/v1/models``."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

from core_support import isolated_settings, make_token
from service_support import Service, serve
from tests.convert_tiny import real_vocab_qwen3

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "Play some jazz in the kitchen, please."}]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with serve(
        tmp_path_factory.mktemp("serve-var"),
        LLMJOBS_HEARTBEAT_INTERVAL_S="1",
        LLMJOBS_RECONCILE_INTERVAL_S="1",
        LLMJOBS_CANCEL_GRACE_S="3",
    ) as svc:
        yield svc


def _area(service: Service, tokenizer: Path) -> Path:
    area = service.var / "data" / "teams" / "default" / "serve"
    shutil.copytree(tokenizer, area / "tok")
    torch.manual_seed(3)
    real_vocab_qwen3(area / "hf", initializer_range=0.5)
    return area


def _hf_greedy(area: Path, max_new: int) -> str:
    tok = AutoTokenizer.from_pretrained(str(area / "tok"))
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    hf = Qwen3ForCausalLM.from_pretrained(area / "hf", dtype=torch.float32).eval()
    stop = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=stop)
    return tok.decode([t for t in out[0, len(ids) :].tolist() if t not in stop], skip_special_tokens=True)


def _other_team_token(service: Service) -> str:
    return make_token(isolated_settings(service.var), "other")


def test_serve_job_streams_greedy_tokens_and_cancels(service: Service, qwen_tokenizer_dir: Path) -> None:
    area = _area(service, qwen_tokenizer_dir)
    body = {
        "kind": "serve",
        "load": "serve/hf",
        "tokenizer_name_or_path": "serve/tok",
        "served_model_name": "e2e-chat",
        "max_num_seqs": 2,
        "max_model_len": 128,
    }
    client = openai.OpenAI(base_url=f"{service.url}/v1", api_key=service.token, max_retries=0)
    with service.client() as http:
        created = http.post("/v1/jobs", json=body)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        deadline = time.monotonic() + 180
        while [m.id for m in client.models.list()] != ["e2e-chat"]:
            assert http.get(f"/v1/jobs/{job_id}").json()["state"] in ("queued", "starting", "running"), http.get(
                f"/v1/jobs/{job_id}"
            ).json()
            assert time.monotonic() < deadline, f"never ready:\n{service.log.read_text()[-3000:]}"
            time.sleep(0.5)
        stream = client.chat.completions.create(
            model="e2e-chat",
            messages=MESSAGES,
            stream=True,
            temperature=0,
            max_tokens=16,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == _hf_greedy(area, 16)
        deadline = time.monotonic() + 30  # the engine's next metrics window (5 s), then the worker's ingest
        names = "serve_requests_total,serve_generation_tokens_per_s,serve_ttft_p50_s"
        while not (points := http.get(f"/v1/jobs/{job_id}/metrics", params={"names": names}).json()["data"]):
            assert time.monotonic() < deadline, "no deployment metrics through the metrics API"
            time.sleep(0.5)
        seen = {p["name"]: p["value"] for p in points}
        assert seen["serve_requests_total"] >= 1 and seen["serve_ttft_p50_s"] > 0, seen
        other = openai.OpenAI(base_url=f"{service.url}/v1", api_key=_other_team_token(service), max_retries=0)
        with pytest.raises(openai.NotFoundError):
            other.chat.completions.create(model="e2e-chat", messages=MESSAGES)

        assert http.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        deadline = time.monotonic() + 60
        while http.get(f"/v1/jobs/{job_id}").json()["state"] != "cancelled":
            assert time.monotonic() < deadline, "cancel did not finish"
            time.sleep(0.3)
        assert list(client.models.list()) == []
