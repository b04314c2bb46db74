"""Starting the service the way `make run` does (`llmjobs serve` on a free port with its own var dir), for e2e tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cli.demo import intent_samples, write_jsonl
from core.settings import REPO_ROOT


@dataclass
class Service:
    url: str
    token: str
    var: Path
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn in a thread of this process on a free port; yields its URL."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _serve_command() -> list[str]:
    script = Path(sys.executable).parent / "llmjobs"  # what `make run` runs
    return [str(script), "serve"] if script.exists() else [sys.executable, "-m", "cli.main", "serve"]


@contextmanager
def serve(var: Path, **settings: str) -> Iterator[Service]:
    """Run `llmjobs serve` with only ``LLMJOBS_VAR_DIR``, a free port and ``settings`` (environment variables) set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMJOBS_")}
    env.update(LLMJOBS_VAR_DIR=str(var), LLMJOBS_PORT=str(free_port()), **settings)
    log = var / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _serve_command(), env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{env['LLMJOBS_PORT']}"
    try:
        _wait_ready(url, var, proc, log)
        yield Service(url, (var / "admin_token").read_text().strip(), var, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_for_pipelines(factory: Any, name: str, **settings: str) -> Iterator[tuple[str, str, Path]]:
    """The body of the pipeline e2e tests' module-scoped ``service`` fixture: ``serve`` in a fresh var dir ``name``
    with heartbeats and reconciles each second and one thread per rank, plus ``settings``; yields the service's URL,
    admin token and var dir."""
    with serve(
        factory.mktemp(name),
        LLMJOBS_HEARTBEAT_INTERVAL_S="1",
        LLMJOBS_RECONCILE_INTERVAL_S="1",
        OMP_NUM_THREADS="1",
        **settings,
    ) as svc:
        yield svc.url, svc.token, svc.var


def team_area(var: Path, name: str, tokenizer: Path, train: int, test: int, write_hf: Callable[[Path], Any]) -> Path:
    """The admin token's team area ``name`` under the service's ``var``, holding the tokenizer (``tok``), ``train``
    and ``test`` intent samples (``train.jsonl`` seed 1, ``test.jsonl`` seed 2) and the model ``write_hf`` writes
    (``hf``)."""
    area = var / "data" / "teams" / "default" / name
    shutil.copytree(tokenizer, area / "tok")
    write_jsonl(area / "train.jsonl", intent_samples(train, seed=1))
    write_jsonl(area / "test.jsonl", intent_samples(test, seed=2))
    write_hf(area / "hf")
    return area


def seed_chain_steps(
    area: str, train: dict[str, Any], eval_batch_size: int, model_flags: dict[str, Any]
) -> list[dict[str, Any]]:
    """The seed's chain as pipeline steps over the team area ``area`` (as ``team_area`` fills it): ``prep``
    (preprocess), ``hf2mg``, ``train`` (``train``'s spec, from the converted checkpoint into ``area/trained``),
    ``mg2hf`` (into ``area/final``), ``eval`` (greedy, 4 new tokens, ``model_flags``)."""
    return [
        {
            "name": "prep",
            "spec": {
                "kind": "preprocess",
                "input": f"{area}/train.jsonl",
                "tokenizer_name_or_path": f"{area}/tok",
                "output_prefix": f"{area}/data/intent",
                "handler_name": "SharegptStyleInstructionHandler",
                "prompt_type": "qwen3",
            },
        },
        {
            "name": "hf2mg",
            "spec": {
                "kind": "convert",
                "load_model_type": "hf",
                "save_model_type": "mg",
                "load_dir": f"{area}/hf",
                "save_dir": f"{area}/mg",
            },
        },
        {
            "name": "train",
            "spec": {
                **train,
                "data_path": "${steps.prep.outputs.data_path}",
                "load": "${steps.hf2mg.outputs.checkpoint}",
                "save": f"{area}/trained",
            },
        },
        {
            "name": "mg2hf",
            "spec": {
                "kind": "convert",
                "load_model_type": "mg",
                "save_model_type": "hf",
                "load_dir": "${steps.train.outputs.checkpoint}",
                "save_dir": f"{area}/final",
            },
        },
        {
            "name": "eval",
            "spec": {
                "kind": "eval",
                "load": "${steps.mg2hf.outputs.checkpoint}",
                "tokenizer_name_or_path": f"{area}/tok",
                "eval_data_path": f"{area}/test.jsonl",
                "max_new_tokens": 4,
                "greedy": True,
                "eval_batch_size": eval_batch_size,
                **model_flags,
            },
        },
    ]


def _wait_ready(url: str, var: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"llmjobs serve exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200 and (var / "admin_token").exists():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"service not ready:\n{log.read_text()[-3000:]}")
