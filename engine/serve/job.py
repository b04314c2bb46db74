"""The ``serve`` job kind: ``python -m engine serve`` (the seed's ``generate_qwen3_4b_ptd.sh``, as a service).

Loads the model as ``eval`` does (``engine.load.inference.build_model``: any of our checkpoint formats, LoRA
adapters unmerged; ``lora_adapters`` kept apart and chosen per request, ``engine.serve.adapters``), allocates the KV
cache of ``max_num_seqs`` slots × ``max_model_len`` positions once, starts the batching loop
(``engine.serve.batcher``) and the engine's HTTP endpoint (``engine.serve.server``), then reports ``ready`` with the
endpoint's URL in the event's data (the API routes requests there, ``docs/serving.md``) and in ``serve.json`` in the
run directory. It runs until the worker stops it (cancel, delete) or, with ``idle_timeout_s``, until no request came
for that long: then it ends successfully with the counts in ``result.json``. A batching loop that failed for good
(``engine.serve.batcher``) ends the job as failed within a second, its endpoint closed: the worker's recovery
retries it (meanwhile the API finds no endpoint there and answers 503).

The endpoint binds to ``LLMJOBS_SERVE_HOST`` (default 127.0.0.1: the API on the same host) and advertises
``LLMJOBS_SERVE_ADVERTISE_HOST`` (default: the bound address) to the API. Under tensor parallelism (one node, every
rank a TP rank) the model is sharded as eval shards it; rank 0 runs the endpoint and the loop and the other ranks
replay its forwards (``engine.serve.tp_sync``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from engine.contract.constants import SERVE_METRICS_INTERVAL_S
from engine.contract.runfiles import RunDir
from engine.contract.spec import ServeSpec
from engine.load.inference import build_model
from engine.load.tokenizer import spec_tokenizer, stop_ids
from engine.parallel.device import Device, init_distributed
from engine.parallel.mesh import build_mesh
from engine.serve.adapters import apply_adapters, read_adapter
from engine.serve.batcher import DEAD, Batcher
from engine.serve.server import Deployment, make_server
from engine.serve.slots import SlotCache
from engine.serve.tp_sync import StepSync

log = logging.getLogger(__name__)

QUEUED_PER_SLOT = 4  # waiting sequences allowed per slot before requests are refused (429)


def _tp_mesh(spec: ServeSpec, device: Device) -> DeviceMesh | None:
    if spec.tensor_model_parallel_size == 1:
        return None
    return build_mesh(device, spec.parallel_dims)["tp"]  # the spec checked the dims when it was parsed


def served_name(spec: ServeSpec, run: RunDir) -> str:
    """``served_model_name``, else the job's name, else its run directory's name (the job id under a worker)."""
    return spec.served_model_name or spec.name or run.path.name


def _write_metrics(batcher: Batcher, run: RunDir, step: int, was_active: bool) -> bool:
    """One deployment-metrics point (``engine.serve.stats``) when this window or the previous one saw requests or
    tokens (an idle deployment writes nothing; its rates go back to 0 once); returns whether this one did."""
    active = batcher.window.active or batcher.busy
    point = batcher.window.window(len(batcher.waiting), len(batcher.running), batcher.cache.usage())
    point |= {f"serve_{name}_total": float(value) for name, value in batcher.stats.items()}
    point["serve_prefix_cache_hit_rate"] = prefix_cache_hit_rate(batcher.stats)
    if active or was_active:
        run.metric(step, point)
    return active


def prefix_cache_hit_rate(stats: dict[str, int]) -> float:
    """The share of the prompt tokens looked up so far that were found cached (0 before any prompt)."""
    return stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"])


class LoopFailed(RuntimeError):
    """The batching loop ended on its own: the job fails (``engine_error``), and the worker retries it."""


def _wait(
    batcher: Batcher,
    loop: threading.Thread,
    run: RunDir,
    idle_timeout_s: float | None,
    stop: threading.Event,
    every: float,
) -> None:
    step, was_active, last = 0, False, time.monotonic()
    while not stop.wait(min(1.0, every)):
        if batcher.state == DEAD or not loop.is_alive():  # never keep listening for a loop that is gone
            raise LoopFailed(f"the serving loop failed and was not restarted; last failure: {batcher.error}")
        if time.monotonic() - last >= every:
            step, last = step + 1, time.monotonic()
            was_active = _write_metrics(batcher, run, step, was_active)
        idle = time.monotonic() - batcher.last_activity
        if idle_timeout_s is not None and not batcher.busy and idle > idle_timeout_s:
            log.info("idle for %.0f s (idle_timeout_s %s): stopping", idle, idle_timeout_s)
            return


def run(
    spec: ServeSpec,
    run: RunDir,
    stop: threading.Event | None = None,
    metrics_interval_s: float = SERVE_METRICS_INTERVAL_S,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Entry point for ``python -m engine serve`` (see the module docstring); ``stop`` ends it (tests); a metrics
    point every ``metrics_interval_s`` while requests come (``engine.serve.stats``)."""
    tokenizer = spec_tokenizer(spec)
    device = init_distributed(spec.resources.device_type)
    tp_mesh = _tp_mesh(spec, device)
    model, cfg, info = build_model(spec, vocab_hint=len(tokenizer), tp_mesh=tp_mesh, device=device.torch_device)
    dtype = next(model.parameters()).dtype
    named = {name: read_adapter(spec, name, path) for name, path in spec.lora_adapters.items()}
    selector, indices = apply_adapters(model, named, device.torch_device) if named else (None, {})
    tp = spec.tensor_model_parallel_size
    kv_heads = cfg.num_query_groups // tp
    cache = SlotCache(cfg, spec.max_num_seqs, spec.max_model_len, dtype, device.torch_device, num_kv_heads=kv_heads)
    batcher = Batcher(
        model,
        cache,
        stop_ids(tokenizer),
        prefill_chunk=spec.max_num_batched_tokens,
        max_waiting=QUEUED_PER_SLOT * spec.max_num_seqs,
        adapters=selector,
        sync=StepSync(device.torch_device) if tp > 1 else None,
        max_batched_tokens=spec.max_num_batched_tokens,
        prefix_caching=spec.enable_prefix_caching,
    )
    if tp_mesh is not None and tp_mesh.get_local_rank() > 0:  # a TP follower: rank 0's steps, until it stops
        assert batcher.sync is not None
        replayed = batcher.sync.follow(batcher)
        log.info("TP rank %d replayed %d steps of rank 0", tp_mesh.get_local_rank(), replayed)
        return {}, {"replayed_steps": replayed, "tensor_model_parallel_size": tp}
    name = served_name(spec, run)
    template = spec.prompt_type or "qwen3"
    deployment = Deployment(batcher, tokenizer, template, name, spec.max_model_len, cfg.vocab_size, indices, spec)
    server = make_server(deployment, os.environ.get("LLMJOBS_SERVE_HOST", "127.0.0.1"))
    host, port = server.server_address[:2]
    url = f"http://{os.environ.get('LLMJOBS_SERVE_ADVERTISE_HOST', host)}:{port}"
    loop = threading.Thread(target=batcher.run_forever, name="serve-loop", daemon=True)
    http = threading.Thread(target=server.serve_forever, name="serve-http", daemon=True)
    loop.start()
    http.start()
    kv_bytes = sum(t.numel() * t.element_size() for t in [*cache.keys.values(), *cache.values.values()])
    facts = {"url": url, "served_model_name": name, "max_model_len": spec.max_model_len, "kv_cache_bytes": kv_bytes}
    facts["lora_adapters"] = {n: a.facts() for n, a in named.items()}
    run.write_json("serve.json", facts)
    run.event("ready", f"serving {name} at {url}", **facts)
    log.info("serving %s at %s (%d slots × %d positions)", name, url, spec.max_num_seqs, spec.max_model_len)
    try:
        _wait(batcher, loop, run, spec.idle_timeout_s, stop or threading.Event(), metrics_interval_s)
    finally:
        server.shutdown()
        server.server_close()
        batcher.stop()
        loop.join(timeout=30)
    summary: dict[str, Any] = {**batcher.stats, "prefix_cache_hit_rate": prefix_cache_hit_rate(batcher.stats)}
    summary |= {"served_model_name": name, "model": {"num_layers": cfg.num_layers, **info}}
    summary["tensor_model_parallel_size"] = tp
    return {"result": str(run.path / "result.json")}, summary
