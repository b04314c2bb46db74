"""The probe's chat flood replayed (issue 39, finding 4): a real `llmjobs api` on loopback and PostgreSQL, two real
engines (``python -m engine serve`` on the tiny real-vocabulary Qwen3), one deployment per team. Team red keeps 150
chat requests going at once for a few seconds (each re-sent as soon as it is answered, a second after a 429); meanwhile
team blue's ``/healthz`` and chat requests keep a p99 under 1 s and never see a 5xx, and red is refused past its
per-team limit with 429s carrying Retry-After in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
from openai_support import deploy

from core.settings import REPO_ROOT
from core_support import fresh_postgres_database, isolated_settings, make_token
from service_support import free_port
from tests.convert_tiny import real_vocab_qwen3

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
RED_CONCURRENCY, LIMIT, FLOOD_S = 150, 8, 10.0  # LIMIT: at most what the red engine queues (2 slots x 4)
MESSAGES = [{"role": "user", "content": "Play some jazz in the kitchen, please."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@dataclass
class Api:
    url: str
    tokens: dict[str, str]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMJOBS_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _wait(proc: subprocess.Popen[bytes], log: Path, ready: object, what: str) -> None:
    deadline = time.monotonic() + 120
    while not ready():  # type: ignore[operator]
        assert proc.poll() is None and time.monotonic() < deadline, f"{what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def _engine(stack: ExitStack, run_dir: Path, model: Path, tokenizer: Path) -> Callable[[], str]:
    """Start ``python -m engine serve`` on ``model`` (2 slots, 128 tokens), stopped with ``stack``; returns what
    waits for it to be ready and gives its URL."""
    run_dir.mkdir(parents=True)
    spec = {"load": str(model), "tokenizer_name_or_path": str(tokenizer), "max_num_seqs": 2, "max_model_len": 128}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "engine", "serve", "--spec", str(run_dir / "spec.json"), "--run-dir", str(run_dir)]
    log, ready = run_dir / "engine.log", run_dir / "serve.json"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=_clean_env(), stdout=out, stderr=subprocess.STDOUT)
    stack.callback(proc.wait, 30)
    stack.callback(proc.terminate)

    def url() -> str:
        _wait(proc, log, ready.is_file, "the engine never became ready")
        return str(json.loads(ready.read_text())["url"])

    return url


def _readyz(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def api(postgres_url: str, qwen_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    var = tmp_path_factory.mktemp("chat-flood")
    torch.manual_seed(3)
    model = real_vocab_qwen3(var / "hf", initializer_range=0.5)
    with ExitStack() as stack:
        url = stack.enter_context(fresh_postgres_database(postgres_url, migrated=True))
        settings = isolated_settings(var, url)
        engines = {team: _engine(stack, var / f"engine-{team}", model, qwen_tokenizer_dir) for team in ("red", "blue")}
        for team, engine_url in engines.items():  # both start at once
            deploy(settings, team, f"{team}-chat", engine_url(), str(model), str(qwen_tokenizer_dir))
        port = free_port()
        env = _clean_env(
            LLMJOBS_VAR_DIR=str(var),
            LLMJOBS_DATABASE_URL=url,
            LLMJOBS_PORT=str(port),
            LLMJOBS_TEAM_MAX_CHAT_REQUESTS=str(LIMIT),
            LLMJOBS_RECONCILE_INTERVAL_S="3600",
            LLMJOBS_LOG_LEVEL="WARNING",
        )
        log = var / "api.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "api"], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        base = f"http://127.0.0.1:{port}"
        try:
            _wait(proc, log, lambda: _readyz(base), "the API never became ready")
            yield Api(base, {team: make_token(settings, team) for team in ("red", "blue")})
        finally:
            proc.terminate()
            proc.wait(30)


@dataclass
class Calls:
    """Latencies (s) and statuses (0: no answer in 15 s) of one kind of call."""

    seconds: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, int(len(ordered) * q))]

    def summary(self) -> str:
        bad = sum(s == 0 or s >= 500 for s in self.statuses)
        return f"{len(self.seconds)} calls, p50 {self.quantile(0.5):.3f} s, p99 {self.quantile(0.99):.3f} s, {bad} 5xx/none"


def _chat(model: str, max_tokens: int) -> dict[str, object]:
    return {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **NO_THINKING}


async def _red_flood(url: str, token: str, seconds: float) -> tuple[list[int], Counter[tuple[str, str, str]]]:
    """Red's callers, each re-sending as soon as it is answered (a second after a 429): (statuses, its 429s by
    (Retry-After, type, code))."""
    statuses: list[int] = []
    refusals: Counter[tuple[str, str, str]] = Counter()
    # a kept-alive connection is dropped well before uvicorn's 5 s keep-alive ends it: a request sent just as the
    # server closes would fail on the client's side, not the API's
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=RED_CONCURRENCY, keepalive_expiry=2.0)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as red:
        end = time.monotonic() + seconds

        async def one_caller() -> None:
            while time.monotonic() < end:
                try:
                    answer = await red.post("/v1/chat/completions", json=_chat("red-chat", 16))
                except httpx.TransportError as err:  # counted as 0
                    statuses.append(0)
                    refusals[("", type(err).__name__, "")] += 1
                    continue
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    error = answer.json()["error"]
                    refusals[(answer.headers.get("Retry-After", ""), error["type"], error["code"])] += 1
                    await asyncio.sleep(1.0)

        await asyncio.gather(*(one_caller() for _ in range(RED_CONCURRENCY)))
    return statuses, refusals


def red_flood(url: str, token: str, seconds: float) -> tuple[list[int], Counter[tuple[str, str, str]]]:
    """``_red_flood`` in a process of its own: its 150 callers do not slow blue's clock-keeping in this one."""
    return asyncio.run(_red_flood(url, token, seconds))


def _blue_calls(api: Api, name: str, seconds: float) -> Calls:
    """Blue calling ``healthz`` or ``chat`` (2 tokens on its own deployment) in a loop for ``seconds``."""
    calls = Calls()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {api.tokens['blue']}"}, timeout=15) as blue:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.monotonic()
            try:
                if name == "healthz":
                    answer = blue.get("/healthz")
                else:
                    answer = blue.post("/v1/chat/completions", json=_chat("blue-chat", 2))
                calls.statuses.append(answer.status_code)
            except httpx.TimeoutException:
                calls.statuses.append(0)
            calls.seconds.append(time.monotonic() - start)
            time.sleep(0.05)
    return calls


def _blue(api: Api, seconds: float) -> dict[str, Calls]:
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(_blue_calls, api, name, seconds) for name in ("healthz", "chat")}
        return {name: f.result() for name, f in futures.items()}


def test_a_chat_flood_leaves_another_team_served(api: Api) -> None:
    for name, calls in _blue(api, 2).items():
        print(f"blue {name}, idle: {calls.summary()}")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        flood = pool.submit(red_flood, api.url, api.tokens["red"], FLOOD_S)
        time.sleep(2.0)  # the process is up and red's requests are in
        blue = _blue(api, FLOOD_S - 3)
        red, refusals = flood.result(timeout=90)
    counts = {status: red.count(status) for status in sorted(set(red))}
    print(f"red: {len(red)} answers {counts}; its 429s by (Retry-After, type, code): {dict(refusals)}")
    for name, calls in blue.items():
        print(f"blue {name}, red flooding: {calls.summary()}")
        assert all(0 < s < 500 for s in calls.statuses), f"{name}: {calls.summary()}"
        assert calls.quantile(0.99) < 1.0, f"{name}: {calls.summary()}"
    assert all(s == 200 for s in blue["chat"].statuses)
    assert refusals[("5", "rate_limit_error", "too_many_requests")] >= RED_CONCURRENCY - LIMIT, refusals
    assert set(counts) <= {200, 429}, counts
    assert counts.get(200, 0) >= LIMIT  # red is served up to its limit, not shut out
