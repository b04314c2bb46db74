"""Preference jobs from the API equal TRL: on the demo's preference pairs (``cli.demo.prepare_demo``, OpenAI's
preference JSONL), TRL's ``DPOTrainer`` (sigmoid DPO) and ``CPOTrainer`` (SimPO) train the demo model for three fp32
steps; their tokenized pairs are uploaded over ``PUT /v1/files`` (the team's ``uploads/``) in MindSpeed's pairwise layout, and a DPO, a SimPO
and a LoRA DPO job submitted over ``POST /v1/jobs`` run on a real worker. The metrics read back over
``GET /v1/jobs/{id}/metrics`` equal TRL's step by step (loss, grad norm, rewards, log-probs); LoRA DPO's first step,
where the adapters are zero and the policy is the base, equals DPO's in everything but the gradient."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from core.settings import Settings
from core_support import team_dir
from demo_fixtures import demo_client, demo_settings
from dpo_support import trl_matched_spec, trl_run, write_trl_pairs
from sched_support import log_text, start_worker, stop_worker, wait_terminal

pytestmark = pytest.mark.slow
STEPS, LR, PAIRS = 3, 1e-3, 4
BOTH = ("rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")
# DPOTrainer's rewards and logits (mean over labelled positions and the vocabulary); CPOTrainer averages its logits
# over every position, prompt and padding included, which ours does not copy (tests/unit/engine/train/test_dpo_job.py)
DPO_ONLY = ("rewards/chosen", "rewards/rejected", "logits/chosen", "logits/rejected")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return demo_settings(tmp_path)


@pytest.fixture
def api(settings: Settings) -> Iterator[tuple[TestClient, dict[str, str]]]:
    with demo_client(settings) as client:
        yield client


def demo_pairs(demo: Path) -> dict[str, list[Any]]:
    """The first pairs of the demo's preference JSONL as TRL's conversational preference dataset."""
    lines = (demo / "intent_pairs.jsonl").read_text(encoding="utf-8").splitlines()[:PAIRS]
    records = [json.loads(line) for line in lines]
    return {
        "prompt": [r["input"]["messages"] for r in records],
        "chosen": [r["preferred_output"] for r in records],
        "rejected": [r["non_preferred_output"] for r in records],
    }


def upload(client: TestClient, headers: dict[str, str], local: Path, remote: str) -> None:
    for path in sorted(local.parent.glob(f"{local.name}*")):
        answer = client.put(f"/v1/files/{remote}/{path.name}", content=path.read_bytes(), headers=headers)
        assert answer.status_code == 201, answer.text


def run_job(client: TestClient, headers: dict[str, str], settings: Settings, data: str, **extra: Any) -> list[dict]:
    spec = trl_matched_spec(data, "demo/qwen3-tiny", STEPS, extra.pop("lr", LR), PAIRS, 256, **extra)
    answer = client.post("/v1/jobs", json=spec, headers=headers)
    assert answer.status_code == 201, answer.text
    job = wait_terminal(settings, answer.json()["id"], 300)
    assert job.state == "succeeded", (job.error, log_text(settings, job.id))
    points = client.get(f"/v1/jobs/{job.id}/metrics", params={"limit": 10000}, headers=headers).json()["data"]
    rows: dict[int, dict[str, float]] = {}
    for p in points:
        if p["rank"] is None:
            rows.setdefault(p["step"], {})[p["name"]] = p["value"]
    return [rows[s] for s in sorted(rows)]


def test_dpo_simpo_and_lora_dpo_jobs_from_the_api_equal_trl(
    settings: Settings, tmp_path: Path, api: tuple[TestClient, dict[str, str]]
) -> None:
    from transformers import AutoModelForCausalLM

    client, headers = api
    demo = team_dir(settings, "demo") / "demo"
    model = AutoModelForCausalLM.from_pretrained(demo / "qwen3-tiny", dtype="float32")
    pairs = demo_pairs(demo)
    dpo, dpo_batch = trl_run(model, demo / "qwen3-tokenizer", tmp_path / "dpo", pairs, STEPS, LR, beta=0.1)
    simpo, simpo_batch = trl_run(
        model, demo / "qwen3-tokenizer", tmp_path / "simpo", pairs, STEPS, LR, loss_type="simpo", beta=2.0,
        simpo_gamma=0.5,
    )  # fmt: skip
    for name, batch in (("dpo", dpo_batch), ("simpo", simpo_batch)):
        (tmp_path / "up" / name).mkdir(parents=True)
        upload(client, headers, Path(write_trl_pairs(batch, tmp_path / "up" / name / "pairs")), f"trl/{name}")
    worker = start_worker(settings, "demo-host", 1, tmp_path / "worker.log")
    try:
        ours_dpo = run_job(client, headers, settings, "uploads/trl/dpo/pairs", dpo_loss_type="sigmoid", dpo_beta=0.1)
        ours_simpo = run_job(
            client, headers, settings, "uploads/trl/simpo/pairs", dpo_loss_type="simpo", dpo_beta=2.0, simpo_gamma=0.5
        )
        ours_lora = run_job(
            client, headers, settings, "uploads/trl/dpo/pairs", dpo_beta=0.1, lora_r=8, lora_alpha=16, lr=1e-2
        )
    finally:
        stop_worker(worker)
    for ours, theirs, names in ((ours_dpo, dpo, BOTH + DPO_ONLY), (ours_simpo, simpo, BOTH)):
        assert len(ours) == len(theirs) == STEPS
        for a, b in zip(ours, theirs, strict=True):
            assert a["lm_loss"] == pytest.approx(b["loss"], rel=1e-5)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
            for name in names:
                assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name
    assert dpo[-1]["loss"] < dpo[0]["loss"]
    first = ours_lora[0]  # adapters zero: the policy is the base, so every figure but the gradient is DPO's
    assert first["lm_loss"] == pytest.approx(dpo[0]["loss"], rel=1e-6)
    for name in BOTH + DPO_ONLY:
        assert first[name] == pytest.approx(dpo[0][name], rel=1e-4, abs=1e-6), name
    assert ours_lora[-1]["lm_loss"] < ours_lora[0]["lm_loss"]  # the adapters learn the preference
