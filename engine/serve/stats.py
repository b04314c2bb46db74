"""Deployment metrics: what a serve job's engine writes to ``metrics.jsonl`` every ``SERVE_METRICS_INTERVAL_S``, so
they reach the metrics API, its SSE stream and the dashboard the way a train job's ``lm_loss`` does.

Per window (between two points; ``step`` counts windows): ``serve_requests_per_s``, ``serve_prompt_tokens_per_s``,
``serve_generation_tokens_per_s``; time to first token (submission to first sampled token, queueing included) and
inter-token latency (between two tokens of one sequence) as ``serve_ttft_p50_s`` / ``_p99_s`` and
``serve_itl_p50_s`` / ``_p99_s`` over the window's samples (nearest rank; absent when the window has none); and the
state at the window's end: ``serve_queue_depth`` (sequences waiting for a slot), ``serve_running`` (holding one) and
``serve_kv_cache_usage`` (positions held / positions allocated); the job adds the running totals
``serve_requests_total``, ``serve_prompt_tokens_total``, ``serve_generated_tokens_total``. vLLM reports the same figures in its Prometheus
metrics (``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``, ``vllm:kv_cache_usage_perc``).
The batcher's loop thread records; the job's main thread reads and resets.
"""

from __future__ import annotations

import math
import threading
import time


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by the nearest-rank method (an observed value, never interpolated)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class ServeStats:
    """The counts and latency samples of the current window."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._requests = self._prompt = self._generated = 0
        self._ttft: list[float] = []
        self._itl: list[float] = []

    def request(self, prompt_tokens: int) -> None:
        with self._lock:
            self._requests += 1
            self._prompt += prompt_tokens

    def token(self, ttft: float | None, gap: float | None) -> None:
        """One sampled token: the first of its sequence (``ttft`` set) or a later one (``gap`` since the previous)."""
        with self._lock:
            self._generated += 1
            if ttft is not None:
                self._ttft.append(ttft)
            if gap is not None:
                self._itl.append(gap)

    @property
    def active(self) -> bool:
        with self._lock:
            return bool(self._requests or self._generated)

    def window(self, queue_depth: int, running: int, kv_usage: float) -> dict[str, float]:
        """This window's metrics (see the module docstring); starts the next window."""
        with self._lock:
            now = time.monotonic()
            seconds = max(now - self._started, 1e-9)
            out = {
                "serve_requests_per_s": self._requests / seconds,
                "serve_prompt_tokens_per_s": self._prompt / seconds,
                "serve_generation_tokens_per_s": self._generated / seconds,
                "serve_queue_depth": float(queue_depth),
                "serve_running": float(running),
                "serve_kv_cache_usage": kv_usage,
            }
            for name, samples in (("ttft", self._ttft), ("itl", self._itl)):
                if samples:
                    out[f"serve_{name}_p50_s"] = nearest_rank(samples, 0.5)
                    out[f"serve_{name}_p99_s"] = nearest_rank(samples, 0.99)
            self._started, self._requests, self._prompt, self._generated = now, 0, 0, 0
            self._ttft, self._itl = [], []
            return out
