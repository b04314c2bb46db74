"""The engine's ``GET /metrics``: Prometheus metrics under vLLM's names, so dashboards and alerts written for vLLM
read a deployment as they are.

Every sample carries ``model_name`` (the base's served name, or the LoRA adapter a request used: vLLM labels
everything with the base) and ``deployment`` (the served name). State, read at scrape time from the batcher:
``vllm:num_requests_running`` (sequences holding a KV slot), ``vllm:num_requests_waiting`` (queued for one),
``vllm:kv_cache_usage_perc`` (cached positions held / allocated, 0 to 1, as vLLM), ``vllm:prefix_cache_queries_total``
and ``vllm:prefix_cache_hits_total`` (prompt tokens looked up / found in the prefix cache). Per request, recorded by
the HTTP handler thread that streams it: ``vllm:request_success_total`` (label ``finished_reason``),
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, and the histograms
``vllm:time_to_first_token_seconds`` (arrival to first token, queueing included), ``vllm:inter_token_latency_seconds``
and ``vllm:e2e_request_latency_seconds``. The API relays a team's deployments' metrics (``GET /v1/metrics``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LABELS = ("model_name", "deployment")
# vLLM's buckets for the request latencies
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class _State(Collector):
    """The batcher's state as gauges and counters, read at each scrape."""

    def __init__(self, batcher: Any, deployment: str) -> None:
        self.batcher, self.deployment = batcher, deployment

    def collect(self) -> Iterator[Any]:
        b, labels = self.batcher, [self.deployment, self.deployment]
        gauges = (
            ("vllm:num_requests_running", "Requests holding a KV-cache slot.", len(b.running)),
            ("vllm:num_requests_waiting", "Requests waiting for a KV-cache slot.", len(b.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache positions held / allocated (1 = full).", b.cache.usage()),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, float(value))
            yield family
        counters = (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
        )
        for name, doc, key in counters:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(labels, float(b.stats.get(key, 0)))
            yield counter


class EngineMetrics:
    """One deployment's registry: the state collector plus the per-request series (see the module docstring)."""

    def __init__(self, batcher: Any, deployment: str) -> None:
        self.deployment = deployment
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_State(batcher, deployment))
        reg = self.registry
        self.success = Counter(
            "vllm:request_success", "Requests finished, by reason.", [*LABELS, "finished_reason"], registry=reg
        )
        self.prompt = Counter("vllm:prompt_tokens", "Prompt tokens of the requests.", LABELS, registry=reg)
        self.generation = Counter("vllm:generation_tokens", "Tokens generated.", LABELS, registry=reg)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Arrival to first token.", LABELS, registry=reg, buckets=TTFT_BUCKETS
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Between two tokens of a sequence.",
            LABELS,
            registry=reg,
            buckets=ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", LABELS, registry=reg, buckets=E2E_BUCKETS
        )

    def labels(self, model_name: str) -> tuple[str, str]:
        return model_name, self.deployment

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestRecord:
    """The per-request series of one request as its handler streams it (times from ``arrived``, monotonic)."""

    def __init__(self, metrics: EngineMetrics, model_name: str, arrived: float) -> None:
        self.m, self.labels, self.arrived = metrics, metrics.labels(model_name), arrived
        self._last: dict[int, float] = {}

    def token(self, index: int) -> None:
        now = time.monotonic()
        if not self._last:
            self.m.ttft.labels(*self.labels).observe(now - self.arrived)
        elif index in self._last:
            self.m.itl.labels(*self.labels).observe(now - self._last[index])
        self._last[index] = now

    def finish(self, reason: str) -> None:
        self.m.success.labels(*self.labels, reason).inc()

    def done(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.m.prompt.labels(*self.labels).inc(prompt_tokens)
        self.m.generation.labels(*self.labels).inc(completion_tokens)
        self.m.e2e.labels(*self.labels).observe(time.monotonic() - self.arrived)
