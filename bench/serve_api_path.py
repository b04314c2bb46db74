"""What the API adds to a streamed generation: our ``serve`` deployment through the API (the ``openai`` client, SSE
chunks from ``app/api/openai_compat.py`` over ``app/engine_proxy.py``) vs straight to the same engine's
``/v1/generate`` (its JSON lines read with httpx) over kept-alive connections as the API's pool keeps them, and
straight to it with a new connection per request (``direct_fresh``: what the API's proxy paid before the engine
spoke HTTP/1.1 keep-alive), the paths rotating wave by wave (A B C, then B C A, ...) on one engine, in one run.

The deployment and model are ``bench/serve_peer.py``'s (the random Qwen3 with the real vocabulary, the API and the
engine in processes of their own, our engine on ``--threads`` OpenMP threads, 1 as the worker gives a CPU engine).
A wave: ``clients`` concurrent greedy streams of ``--max-tokens`` tokens, 20-token chat prompts. Per path and row:
generated tokens/s, TTFT p50/p99 (time to the first non-empty text), each side's median over its waves; the ratio
API / direct, the TTFT p50 ratio fresh / kept-alive connections, and the outputs the API and direct paths agree on.
The last line is one JSON object.

    .venv/bin/python bench/serve_api_path.py [--clients 8,32] [--waves 2] [--max-tokens 64] [--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from serve_peer import load, make_prompts, one, pct, start_ours, write_model  # noqa: E402


def direct(client: Any, engine_url: str, msgs: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One request straight to the engine on ``client`` (one httpx.Client for all: building one costs ~23 ms of
    TLS context, which would count in each TTFT; its pool keeps connections alive or not), timed as
    ``serve_peer.one`` times one through the API."""
    body = {"messages": msgs, "max_tokens": max_tokens, "temperature": 0}
    body["chat_template_kwargs"] = {"enable_thinking": False}
    start, stamps, text = time.perf_counter(), [], ""
    with client.stream("POST", f"{engine_url}/v1/generate", json=body) as answer:
        for raw in answer.iter_lines():
            line = json.loads(raw) if raw else {}
            if line.get("type") == "token" and line.get("text"):
                stamps.append(time.perf_counter())
                text += line["text"]
    ttft = (stamps[0] if stamps else time.perf_counter()) - start
    return {"text": text, "tokens": len(stamps), "ttft": ttft, "gaps": [b - a for a, b in itertools.pairwise(stamps)]}


def wave(request: Any, prompts: list[list[dict[str, str]]]) -> dict[str, Any]:
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(request, prompts))
    wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results]
    return {
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "texts": [r["text"] for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--waves", type=int, default=2, help="waves per path and row (A B, B A, ...)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="our engine's OpenMP threads")
    parser.add_argument("--smoke", action="store_true", help="one 2-client wave of 8 tokens per path")
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.waves, args.max_tokens = "2", 1, 8
    import httpx
    from transformers import AutoTokenizer

    clients = [int(c) for c in args.clients.split(",")]
    loads, rows = [load()], []
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "side.log", "wb") as log:
        root = Path(tmp)
        model_dir = write_model(root / "model")
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        side = start_ours(root, model_dir, max(clients), 20 + 64 + args.max_tokens, log, args.threads)
        engine_url = json.loads((root / "run" / "serve.json").read_text())["url"]
        # kept alive as the API's pool keeps them (app/engine_proxy.py), and a new connection per request
        http = httpx.Client(timeout=1800, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        fresh = httpx.Client(timeout=1800, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
        paths = {
            "api": lambda m: one(side, m, args.max_tokens),
            "direct": lambda m: direct(http, engine_url, m, args.max_tokens),
            "direct_fresh": lambda m: direct(fresh, engine_url, m, args.max_tokens),
        }
        names = list(paths)
        try:
            for request in paths.values():  # warm-up: first-request costs are not throughput
                request([{"role": "user", "content": "hello"}])
            for count in clients:
                waves: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
                for w in range(args.waves):
                    prompts = make_prompts(tok, "20", count, seed=1000 * w + count)
                    for name in names[w % len(names) :] + names[: w % len(names)]:
                        waves[name].append(wave(paths[name], prompts))
                        loads.append(load())
                row: dict[str, Any] = {"clients": count, "waves": args.waves}
                for name, got in waves.items():
                    keys = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s")
                    row[name] = {k: round(statistics.median(w[k] for w in got), 4) for k in keys}
                row["ratio_tokens_per_s"] = round(row["api"]["tokens_per_s"] / row["direct"]["tokens_per_s"], 3)
                row["ttft_p50_fresh_over_kept"] = round(
                    row["direct_fresh"]["ttft_p50_s"] / row["direct"]["ttft_p50_s"], 3
                )
                equal = sum(
                    a == b
                    for x, y in zip(waves["api"], waves["direct"], strict=True)
                    for a, b in zip(x["texts"], y["texts"], strict=True)
                )
                row["outputs_equal"] = f"{equal}/{count * args.waves}"
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            http.close()
            fresh.close()
            side.close()
    summary = {"bench": "serve_api_path", "smoke": args.smoke, "max_tokens": args.max_tokens, "threads": args.threads}
    print(json.dumps({**summary, "load_min": min(loads), "load_max": max(loads), "rows": rows}))


if __name__ == "__main__":
    main()
