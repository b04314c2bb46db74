"""Serving throughput: 32 concurrent streaming clients (the ``openai`` package) through the API and a ``serve``
engine vs the same prompts one by one through ``transformers``' ``generate``, on the demo-sized model on CPU.

Both sides decode greedily with the same weights (the demo model, ``cli.demo.write_tiny_model``) and the same
``max_tokens``. The service side is real: ``create_app`` under uvicorn on a free port with a SQLite database, a team
token, and a ``serve`` deployment whose engine (``engine.serve.job.run``) runs in this process; requests go
client -> API -> engine endpoint -> batching loop. Figures: ``throughput_ratio`` (generated tokens/s, served over
one by one, the median of ``--pairs`` pairs of waves, served then one by one, then the other way round:
``bench/common/pairs.py``; target >= 4), TTFT p50/p99 of the served requests, ``greedy_equal`` (prompts whose
streamed text equals transformers' greedy text; must equal ``prompts``). Ends with one JSON line.

    .venv/bin/python bench/serve.py [--clients 32] [--max-tokens 64] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import torch
import uvicorn
from transformers import AutoTokenizer, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from app.main import create_app
from bench.common.chat_stream import pct, stream_chat  # noqa: E402
from bench.common.pairs import alternate, pair_ratios  # noqa: E402
from cli.demo import intent_samples, tokenizer_source, write_tiny_model
from core import secrets_box
from core.auth import create_token
from core.db import session_scope, upgrade_head
from core.jobs import create_job
from core.models import Event, Job
from core.settings import Settings
from engine.contract.runfiles import RunDir
from engine.contract.spec import parse_spec
from engine.serve.job import run as serve_run

NAME = "bench-chat"


def _messages(count: int) -> list[list[dict[str, str]]]:
    """Chat prompts of the demo's intent data (their lengths differ)."""
    return [[{"role": "user", "content": s["messages"][-2]["content"]}] for s in intent_samples(count, seed=5)]


def _baseline(model_dir: Path, prompts: list[list[dict[str, str]]], max_tokens: int) -> Callable[[], dict[str, Any]]:
    """The baseline's wave: the prompts one by one through ``generate``; its texts, tokens and seconds."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stop = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]

    def wave() -> dict[str, Any]:
        texts, produced, start = [], 0, time.perf_counter()
        for msgs in prompts:
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False, return_dict=False)
            with torch.no_grad():
                out = hf.generate(
                    input_ids=torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=stop
                )
            new = out[0, len(ids) :].tolist()
            produced += len(new)
            texts.append(tok.decode([t for t in new if t not in stop], skip_special_tokens=True))
        return {"side": "baseline", "texts": texts, "tokens": produced, "seconds": time.perf_counter() - start}

    return wave


def _start_engine(model_dir: Path, run_dir: Path, slots: int) -> tuple[str, threading.Event, threading.Thread]:
    spec = parse_spec({"kind": "serve", "load": str(model_dir), "max_num_seqs": slots, "max_model_len": 512})
    stop = threading.Event()
    thread = threading.Thread(target=serve_run, args=(spec, RunDir(run_dir), stop), daemon=True)
    thread.start()
    while not (run_dir / "serve.json").is_file():
        if not thread.is_alive():
            raise RuntimeError("the engine stopped before it was ready")
        time.sleep(0.1)
    return json.loads((run_dir / "serve.json").read_text())["url"], stop, thread


def _start_api(var: Path, model_dir: Path, engine_url: str) -> tuple[str, str, uvicorn.Server, threading.Thread]:
    settings = Settings(var_dir=var, database_url="", broker_url="", redis_url=None, data_roots=[], runs_dir=None)
    settings.ensure_dirs()
    upgrade_head(settings.database_url, secrets_box.keys(settings))
    raw = {"kind": "serve", "load": str(model_dir), "served_model_name": NAME}
    with session_scope(settings.database_url) as session:
        job, _ = create_job(session, settings=settings, team="bench", spec=parse_spec(raw), raw=raw)
        session.query(Job).filter(Job.id == job.id).update({"state": "running", "attempt_count": 1})
        session.add(Event(job_id=job.id, attempt=1, type="ready", data={"url": engine_url}))
        token = create_token(session, team="bench")
    config = uvicorn.Config(create_app(settings, reconcile=False), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="api", daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}/v1", token, server, thread


def _stop(server: uvicorn.Server, api: threading.Thread, stop: threading.Event, engine: threading.Thread) -> None:
    """Both servers stopped and their threads joined before the interpreter exits: a daemon thread still running
    (the API's shutdown, under load) when it finalizes is killed mid-call, which aborted CI's smoke once
    ("terminate called without an active exception" after the JSON line)."""
    server.should_exit = True
    api.join(timeout=60)
    stop.set()
    engine.join(timeout=60)
    alive = [t.name for t in (api, engine) if t.is_alive()]
    if alive:
        raise RuntimeError(f"still running after 60 s: {alive}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3, help="pairs of waves, served and one by one (A B, B A, ...)")
    parser.add_argument("--smoke", action="store_true", help="4 clients, 8 tokens, one pair: seconds, same code path")
    args = parser.parse_args()
    if args.smoke:
        args.pairs = 1
    clients, max_tokens = (4, 8) if args.smoke else (args.clients, args.max_tokens)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_tiny_model(root / "model", tokenizer_source(), seed=0)
        prompts = _messages(clients)
        baseline = _baseline(model_dir, prompts, max_tokens)
        engine_url, stop, engine = _start_engine(model_dir, root / "run", clients)
        api_url, token, server, api = _start_api(root / "var", model_dir, engine_url)
        client = openai.OpenAI(base_url=api_url, api_key=token, max_retries=0, timeout=600)
        stream_chat(client, NAME, prompts[0], 2)  # warm-up: first-request costs are not throughput

        def served() -> dict[str, Any]:
            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                results = list(pool.map(lambda m: stream_chat(client, NAME, m, max_tokens), prompts))
            return {"side": "served", "results": results, "seconds": time.perf_counter() - start}

        waves = {"served": served, "baseline": baseline}
        rounds = alternate(lambda side: waves[side](), ("served", "baseline"), args.pairs, log=_log)
        client.close()
        _stop(server, api, stop, engine)
    rates = [
        {
            "served": sum(r["tokens"] for r in pair["served"]["results"]) / pair["served"]["seconds"],
            "baseline": pair["baseline"]["tokens"] / pair["baseline"]["seconds"],
        }
        for pair in rounds
    ]
    ttft = [r["ttft"] for pair in rounds for r in pair["served"]["results"]]
    expected = rounds[0]["baseline"]["texts"]
    figures = {
        "bench": "serve",
        "clients": clients,
        "max_tokens": max_tokens,
        "served_tokens_per_s": [round(r["served"], 1) for r in rates],
        "baseline_tokens_per_s": [round(r["baseline"], 1) for r in rates],
        **pair_ratios("throughput_ratio", [r["served"] / r["baseline"] for r in rates]),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "greedy_equal": sum(r["text"] == e for r, e in zip(rounds[0]["served"]["results"], expected, strict=True)),
        "prompts": clients,
        "smoke": args.smoke,
    }
    print(json.dumps(figures))


def _log(wave: dict[str, Any]) -> None:
    tokens = wave["tokens"] if wave["side"] == "baseline" else sum(r["tokens"] for r in wave["results"])
    print(f"{wave['side']}: {tokens} tokens in {wave['seconds']:.2f} s", flush=True)


if __name__ == "__main__":
    main()
