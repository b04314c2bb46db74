"""Deployment metrics (``engine.serve.stats``): a serve job under load writes points to ``metrics.jsonl`` (what the
worker ingests into the metrics API and its SSE stream) with request and token rates, TTFT and inter-token latency
percentiles, queue depth, running sequences and KV-cache use; totals match what was streamed; an idle deployment
writes one point with the rates back at 0, then nothing."""

from __future__ import annotations

import json
import threading
import time

import httpx

from engine.serve.stats import ServeStats, nearest_rank
from tests.unit.serve_support import running_engine

PROMPTS = [[9707, 11, 1879, 0], [785, 3974, 13876, 38835, 34208, 916], [40, 1079]]


def _generate(url: str, prompt: list[int], out: list[int]) -> None:
    body = {"prompt_token_ids": prompt, "max_tokens": 8, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/generate", json=body, timeout=60) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x]
    out.append(lines[-1]["usage"]["completion_tokens"])


def _points(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def test_a_loaded_deployment_writes_its_metrics(serve_model_dir, qwen_tokenizer_dir, tmp_path) -> None:
    spec = {"load": str(serve_model_dir), "tokenizer_name_or_path": str(qwen_tokenizer_dir), "max_num_seqs": 2}
    with running_engine(tmp_path, metrics_interval_s=0.3, **spec, max_model_len=64) as (url, _):
        time.sleep(1.0)
        assert _points(tmp_path) == []  # nothing came: nothing written
        generated: list[int] = []
        threads = [threading.Thread(target=_generate, args=(url, p, generated)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + 10
        while not (_points(tmp_path) and _points(tmp_path)[-1]["metrics"]["serve_generation_tokens_per_s"] == 0):
            assert time.monotonic() < deadline, _points(tmp_path)
            time.sleep(0.1)
        time.sleep(1.0)
    points = _points(tmp_path)
    assert [p["step"] for p in points] == sorted({p["step"] for p in points})
    last = points[-1]["metrics"]
    assert last["serve_generated_tokens_total"] == sum(generated) and last["serve_requests_total"] == 3
    assert last["serve_prompt_tokens_total"] == sum(map(len, PROMPTS))
    assert last["serve_queue_depth"] == last["serve_running"] == last["serve_kv_cache_usage"] == 0
    busy = [p["metrics"] for p in points if p["metrics"]["serve_generation_tokens_per_s"] > 0]
    assert busy and all(0 <= m["serve_kv_cache_usage"] <= 1 for m in busy)
    ttft = [m for m in busy if "serve_ttft_p50_s" in m]
    assert ttft and all(0 < m["serve_ttft_p50_s"] <= m["serve_ttft_p99_s"] for m in ttft)
    assert any(0 < m["serve_itl_p50_s"] <= m["serve_itl_p99_s"] for m in busy if "serve_itl_p50_s" in m)
    rates = ("serve_requests_per_s", "serve_prompt_tokens_per_s", "serve_generation_tokens_per_s")
    idle = [p for p in points if all(p["metrics"][r] == 0 for r in rates)]
    assert idle == points[-1:]  # once idle: one point with the rates back at 0, then none


def test_window_percentiles_and_rates() -> None:
    assert nearest_rank([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert nearest_rank([float(i) for i in range(1, 101)], 0.99) == 99.0
    stats = ServeStats()
    stats.request(7)
    for ttft, gap in [(0.2, None), (None, 0.01), (None, 0.03)]:
        stats.token(ttft, gap)
    point = stats.window(queue_depth=1, running=2, kv_usage=0.25)
    assert point["serve_ttft_p50_s"] == point["serve_ttft_p99_s"] == 0.2
    assert point["serve_itl_p50_s"] == 0.01 and point["serve_itl_p99_s"] == 0.03
    assert point["serve_queue_depth"] == 1 and point["serve_running"] == 2 and point["serve_kv_cache_usage"] == 0.25
    assert point["serve_generation_tokens_per_s"] > 0 and not stats.active
    assert "serve_ttft_p50_s" not in stats.window(0, 0, 0.0)  # the next window starts empty
