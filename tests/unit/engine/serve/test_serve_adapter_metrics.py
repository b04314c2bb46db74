"""The engine's vLLM-named metrics are labelled by the LoRA adapter a request used (vLLM labels every request with the
base's name): a request through an adapter counts under ``model_name`` = the adapter, one on the base under the
base, both with ``deployment`` = the served name."""

from __future__ import annotations

import re

import httpx

from tests.unit.serve_support import running_engine, write_lora_checkpoint


def _count(text: str, metric: str, model_name: str) -> float:
    found = re.search(rf'{re.escape(metric)}\{{deployment="tiny-base",model_name="{model_name}"\}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_metrics_are_labelled_by_adapter(serve_model_dir, qwen_tokenizer_dir, tmp_path) -> None:
    lora = write_lora_checkpoint(serve_model_dir, tmp_path / "jazz", 1, 4, 8.0, ["linear_qkv"])
    spec = {
        "load": str(serve_model_dir),
        "tokenizer_name_or_path": str(qwen_tokenizer_dir),
        "served_model_name": "tiny-base",
        "lora_adapters": {"jazz-lora": str(lora)},
        "max_num_seqs": 2,
    }
    with running_engine(tmp_path / "run", **spec, max_model_len=64) as (url, _):
        for model, tokens in (("jazz-lora", 3), ("jazz-lora", 2), ("tiny-base", 4)):
            body = {"model": model, "prompt": "Hi", "max_tokens": tokens, "temperature": 0}
            with httpx.stream("POST", f"{url}/v1/generate", json=body, timeout=60) as r:
                assert r.status_code == 200 and [x for x in r.iter_lines() if x][-1].startswith('{"type": "done"')
        text = httpx.get(f"{url}/metrics", timeout=30).text
    assert _count(text, "vllm:time_to_first_token_seconds_count", "jazz-lora") == 2
    assert _count(text, "vllm:time_to_first_token_seconds_count", "tiny-base") == 1
    assert _count(text, "vllm:generation_tokens_total", "jazz-lora") == 5
    assert _count(text, "vllm:generation_tokens_total", "tiny-base") == 4
    assert _count(text, "vllm:inter_token_latency_seconds_count", "jazz-lora") == 3
