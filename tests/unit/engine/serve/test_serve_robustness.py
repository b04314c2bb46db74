"""A request cannot kill or wedge a deployment (issue 39, finding 2 and the engine's low items of finding 6).

- Sampling: every value the documented ranges admit gives a valid token (``repetition_penalty`` 1e-300 made fp32
  logits infinite and ``torch.multinomial`` raise, killing the batching thread); wrong types are a 400 naming the
  field.
- The loop: a failed step (a fault injected into the model's forward) fails the requests in flight with an error,
  health is 503 while the loop restarts, and the next request answers; a loop that keeps failing ends the job as
  failed with its endpoint closed.
- A client that hangs up, streaming or while its request is queued, frees its slot at once.
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.contract.runfiles import RunDir
from engine.contract.serve_request import MAX_LOGPROBS, SamplingOptions
from engine.contract.spec import ServeSpec
from engine.eval.remote import RemoteOptions, generate_one
from engine.serve import batcher as batcher_module
from engine.serve import server as server_module
from engine.serve.batcher import READY, Batcher, Sequence
from engine.serve.job import LoopFailed, run
from engine.serve.protocol import BadRequest, parse_options
from engine.serve.sampling import RequestOptions, SamplingError, pick_token
from engine.serve.slots import SlotCache

V = 48
PROMPT = [9707, 11, 1879, 0, 374]  # token ids of the real vocabulary (no stop token among them)

# ------------------------------------------------------------------ sampling over the documented ranges

_tiny_or_any = st.one_of(st.sampled_from([5e-324, 1e-300, 1e-30]), st.floats(0.0, 10.0, exclude_min=True))


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=V, max_size=V),
    temperature=st.one_of(st.sampled_from([0.0, 1e-300, 1e-3, 2.0]), st.floats(0.0, 2.0)),
    top_p=st.one_of(st.sampled_from([5e-324, 1.0]), st.floats(0.0, 1.0, exclude_min=True)),
    top_k=st.integers(0, V + 4),
    presence=st.floats(-2.0, 2.0),
    frequency=st.floats(-2.0, 2.0),
    repetition=_tiny_or_any,
    seen=st.lists(st.integers(0, V - 1), max_size=12),
    output=st.lists(st.integers(0, V - 1), max_size=12),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    seed=st.integers(-(2**63), 2**64 - 1),
)
def test_pick_token_always_returns_a_valid_token(
    logits, temperature, top_p, top_k, presence, frequency, repetition, seen, output, logprobs, seed
) -> None:
    opts = RequestOptions(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logprobs=logprobs,
        seed=seed,
    )
    pick = pick_token(torch.tensor(logits), opts, seen, output, opts.generator(0, torch.device("cpu")))
    assert 0 <= pick.token < V
    if logprobs is not None:
        assert pick.logprob is not None and not math.isnan(pick.logprob) and pick.logprob <= 0


def test_the_models_own_non_finite_logits_fail_that_sequence_only() -> None:
    with pytest.raises(SamplingError, match="not finite"):
        pick_token(torch.tensor([0.0, float("nan")]), RequestOptions(), [0], [], None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop", [1, 2]),  # answered 200 with empty content and finish_reason null
        ("stop", {"a": 1}),
        ("temperature", "hot"),
        ("temperature", True),
        ("temperature", float("nan")),
        ("presence_penalty", float("inf")),
        ("repetition_penalty", [1.0]),
        ("top_p", "0.5"),
        ("n", 1.5),
        ("max_tokens", "5"),
        ("seed", 2**70),
        ("logprobs", True),
        ("top_k", 2.0),
        ("stream", "yes"),
        ("tools", "x"),
        ("model", 5),
    ],
)
def test_a_wrong_type_is_refused_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(BadRequest) as err:
        parse_options({"prompt": "hi", field: value})
    assert err.value.field == field and err.value.status == 400, str(err.value)


def test_a_sequence_that_cannot_be_sampled_fails_alone(monkeypatch) -> None:
    from engine.contract.model_config import preset
    from engine.model.qwen3 import Qwen3Model

    torch.manual_seed(0)
    model = Qwen3Model(preset("qwen3-tiny")).eval()
    original = Batcher._compute
    calls = itertools.count()

    def nan_once(self, *args, **kwargs):  # the model's forward gives NaN logits once: a model fault
        logits = original(self, *args, **kwargs)
        return logits * float("nan") if next(calls) == 0 else logits

    monkeypatch.setattr(Batcher, "_compute", nan_once)
    batcher = Batcher(model, SlotCache(model.cfg, 2, 32), set())
    bad, good = Sequence([5, 6], RequestOptions(temperature=0.0), 4), Sequence([7, 8], RequestOptions(), 4)
    batcher.submit([bad])
    batcher.step()
    batcher.submit([good])
    while batcher.busy:
        batcher.step()
    assert bad.finish_reason == "error" and "not finite" in (bad.error or "")
    assert good.finish_reason == "length" and len(good.output) == 4
    assert batcher.state == READY and sorted(batcher.cache.free) == [0, 1]


# ------------------------------------------------------------------ the engine, in this process


class Engine:
    """``engine.serve.job.run`` in a thread; ``outcome`` holds its summary or the exception it ended with."""

    def __init__(self, run_dir: Path, **spec: Any) -> None:
        self.rundir, self.stop = RunDir(run_dir), threading.Event()
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(ServeSpec(**spec),), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not (self.rundir.path / "serve.json").is_file():
            assert self.thread.is_alive() and time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.2)
        self.url = json.loads((self.rundir.path / "serve.json").read_text())["url"]

    def _run(self, spec: ServeSpec) -> None:
        try:
            self.outcome["summary"] = run(spec, self.rundir, self.stop, 5.0)[1]
        except Exception as err:  # noqa: BLE001 - the test reads it
            self.outcome["error"] = err

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def engine(serve_model_dir, qwen_tokenizer_dir, tmp_path_factory) -> Iterator[Engine]:
    spec = {"load": str(serve_model_dir), "tokenizer_name_or_path": str(qwen_tokenizer_dir), "max_num_seqs": 2}
    eng = Engine(tmp_path_factory.mktemp("run"), **spec, max_model_len=128)
    yield eng
    eng.close()


@pytest.fixture
def patient(monkeypatch) -> None:
    """The module's engine survives every injected fault of these tests and restarts quickly."""
    monkeypatch.setattr(batcher_module, "MAX_CRASHES", 100)
    monkeypatch.setattr(batcher_module, "RESTART_DELAY_S", 0.1)


def _faults(monkeypatch, fail: Callable[[int], bool], delay_s: float = 0.0) -> None:
    """Fault injection at the model's forward: call ``i`` (from 0) raises when ``fail(i)``; each waits ``delay_s``."""
    original, calls = Batcher._compute, itertools.count()

    def compute(self, *args, **kwargs):
        time.sleep(delay_s)
        if fail(next(calls)):
            raise RuntimeError("injected fault")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Batcher, "_compute", compute)


def _post(url: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    with httpx.stream("POST", f"{url}/v1/generate", json=body, timeout=30) as r:
        return r.status_code, [json.loads(line) for line in r.iter_lines() if line]


def _answers(url: str) -> None:
    status, lines = _post(url, {"prompt_token_ids": PROMPT, "max_tokens": 4, "temperature": 0})
    assert status == 200 and lines[-1]["type"] == "done", lines
    assert [x["finish_reason"] for x in lines if x["type"] == "finish"] in (["length"], ["stop"])


def test_the_1e300_repetition_penalty_replay_is_served(engine, patient) -> None:
    for temperature in (1.0, 0.0):
        body = {"prompt_token_ids": PROMPT, "repetition_penalty": 1e-300, "temperature": temperature, "seed": 1}
        status, lines = _post(engine.url, {**body, "max_tokens": 6})
        assert status == 200 and lines[-1]["type"] == "done", lines
    assert engine.health().json()["status"] == "ready"
    _answers(engine.url)


def test_a_stop_list_of_non_strings_is_a_400(engine) -> None:
    r = httpx.post(f"{engine.url}/v1/generate", json={"prompt": "hi", "stop": [1, 2]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["field"] == "stop", r.text


def test_a_failed_step_fails_the_request_health_drops_and_the_next_request_answers(
    engine, patient, monkeypatch
) -> None:
    monkeypatch.setattr(batcher_module, "RESTART_DELAY_S", 3.0)  # long enough to see health while it restarts
    _faults(monkeypatch, lambda i: i == 0)
    status, lines = _post(engine.url, {"prompt_token_ids": PROMPT, "max_tokens": 4})
    # before its first token: a plain 500 in the engine's error shape (the API relays it in OpenAI's)
    assert status == 500 and lines[0]["error"]["type"] == "engine_error", lines
    health = engine.health()
    assert health.status_code == 503 and health.json()["status"] == "restarting"
    assert "injected fault" in health.json()["error"]
    deadline = time.monotonic() + 10
    while engine.health().status_code != 200:
        assert time.monotonic() < deadline, "the loop never came back"
        time.sleep(0.1)
    _answers(engine.url)


def test_a_step_failing_mid_stream_ends_it_with_an_error_line(engine, patient, monkeypatch) -> None:
    _faults(monkeypatch, lambda i: i == 2)  # prefill and one decode step pass: two tokens out, then the fault
    status, lines = _post(engine.url, {"prompt_token_ids": PROMPT, "max_tokens": 8, "temperature": 0})
    assert status == 200 and [x["type"] for x in lines] == ["start", "token", "token", "error"], lines
    assert lines[-1]["error"]["type"] == "engine_error"
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while engine.health().status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _answers(engine.url)


@pytest.mark.parametrize("failing_call", [0, 2])  # before the first token (a 500), after two (an error line)
def test_an_eval_on_the_deployment_fails_retryably_not_with_an_empty_answer(
    engine, patient, monkeypatch, failing_call
) -> None:
    opts = RemoteOptions(SamplingOptions(max_tokens=8, temperature=0.0, seed=0), None, frozenset())
    _faults(monkeypatch, lambda i: i == failing_call)
    with pytest.raises(RuntimeError, match="the job is retried"):
        generate_one(engine.url, PROMPT, opts)
    monkeypatch.undo()
    _wait_for(engine, lambda h: h["status"] == "ready", "the loop never came back")
    assert len(generate_one(engine.url, PROMPT, opts)["tokens"]) > 0


def _raw_request(url: str, body: dict[str, Any], version: str = "HTTP/1.0") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    head = f"POST /v1/generate {version}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.parametrize("length", ["\N{SUPERSCRIPT TWO}", "-1", "1e3", ""])
def test_a_garbled_content_length_is_a_400_naming_the_body(engine, length) -> None:
    host, port = engine.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n"
        sock.sendall(head.encode("latin-1"))
        answer = sock.makefile("rb").read()  # the unread body ends the connection after the answer
    assert answer.startswith(b"HTTP/1.1 400") and b'"field": "body"' in answer, answer[:300]


def _wait_for(engine: Engine, ok: Callable[[dict[str, Any]], bool], what: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while not ok(health := engine.health().json()):
        assert time.monotonic() < deadline, f"{what}: {health}"
        time.sleep(0.05)
    return health


@pytest.mark.parametrize("version", ["HTTP/1.0", "HTTP/1.1"])  # its stream ended by the close / chunked, kept alive
def test_a_client_that_leaves_mid_stream_stops_its_generation(engine, monkeypatch, version) -> None:
    body = {"prompt_token_ids": PROMPT, "max_tokens": 100, "temperature": 0}
    status, lines = _post(engine.url, body)  # left alone, this request generates all 100 tokens
    assert status == 200 and lines[-2]["finish_reason"] == "length", lines[-2:]
    _faults(monkeypatch, lambda i: False, delay_s=0.05)  # slow steps: 100 tokens would take 5 s
    before = engine.health().json()["generated_tokens"]
    sock = _raw_request(engine.url, body, version)
    reader = sock.makefile("rb")
    while not reader.readline().startswith(b'{"type": "token"'):  # (a chunk's size line comes before its line)
        pass
    reader.close()
    sock.close()  # as the API does when its client leaves, streaming or not (it always reads the engine's stream)
    health = _wait_for(engine, lambda h: h["running"] == 0 and h["free_slots"] == 2, "the slot was not freed")
    assert health["generated_tokens"] - before < 20


def _connection(url: str) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


def _exchange(conn: http.client.HTTPConnection, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    answer = conn.getresponse()
    return answer.status, answer.read()


def test_one_connection_carries_request_after_request(engine) -> None:
    """HTTP/1.1 keep-alive (the API's pooled client): streamed answers (chunked), refusals and health, one after the
    other on one socket; a body left unread (a refused path) ends the connection, lest it be read as a request."""
    conn = _connection(engine.url)
    body = {"prompt_token_ids": PROMPT, "max_tokens": 3, "temperature": 0}
    status, raw = _exchange(conn, "POST", "/v1/generate", body)
    sock = conn.sock
    assert status == 200 and sock is not None
    first = [json.loads(line) for line in raw.splitlines() if line]
    assert [x["type"] for x in first] == ["start", "token", "token", "token", "finish", "done"], first
    assert _exchange(conn, "POST", "/v1/generate", {**body, "stop": [1]})[0] == 400
    assert _exchange(conn, "GET", "/health")[0] == 200
    status, raw = _exchange(conn, "POST", "/v1/generate", body)
    assert status == 200 and [json.loads(line) for line in raw.splitlines() if line] == first
    assert conn.sock is sock  # the same connection throughout: never closed, never reopened
    conn.request("POST", "/nowhere", b'{"a": 1}', {"Content-Type": "application/json"})
    answer = conn.getresponse()
    assert answer.status == 404 and answer.getheader("Connection") == "close"
    answer.read()
    assert conn.sock is None  # http.client closed it as told
    conn.close()


def test_an_idle_kept_alive_connection_is_closed_by_the_engine(engine, monkeypatch) -> None:
    """A connection waiting for its next request longer than IDLE_S frees its thread (the API's pool lets its own go
    sooner)."""
    monkeypatch.setattr(server_module, "IDLE_S", 0.3)
    conn = _connection(engine.url)
    assert _exchange(conn, "GET", "/health")[0] == 200
    assert conn.sock is not None
    conn.sock.settimeout(5)
    start = time.monotonic()
    assert conn.sock.recv(1) == b""  # end-of-file: the engine closed it
    assert time.monotonic() - start < 3
    conn.close()


def test_a_request_head_that_stalls_is_closed_by_the_engine(engine, monkeypatch) -> None:
    """A request line, then headers that never end: the wait for the rest of the head is under IDLE_S too."""
    monkeypatch.setattr(server_module, "IDLE_S", 0.3)
    host, port = engine.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        assert sock.recv(1) == b""  # end-of-file: the engine closed it
        assert time.monotonic() - start < 3


def test_a_client_asking_to_close_still_gets_the_last_chunk(engine) -> None:
    """``Connection: close`` (urllib's way, the remote eval's client): the answer is whole, its last chunk sent."""
    conn = _connection(engine.url)
    body = json.dumps({"prompt_token_ids": PROMPT, "max_tokens": 2, "temperature": 0}).encode()
    conn.request("POST", "/v1/generate", body, {"Content-Type": "application/json", "Connection": "close"})
    answer = conn.getresponse()
    raw = answer.read()  # http.client raises IncompleteRead for a chunked answer cut before its last chunk
    assert answer.getheader("Transfer-Encoding") == "chunked"
    assert [json.loads(line)["type"] for line in raw.splitlines() if line][-1] == "done"
    conn.close()


def test_a_client_that_leaves_while_queued_is_dropped_before_it_runs(engine, monkeypatch) -> None:
    _faults(monkeypatch, lambda i: False, delay_s=0.05)
    body = {"prompt_token_ids": PROMPT, "max_tokens": 100, "temperature": 0}
    busy = [_raw_request(engine.url, body) for _ in range(2)]  # both slots
    _wait_for(engine, lambda h: h["running"] == 2, "the slots were not taken")
    queued = _raw_request(engine.url, body)
    _wait_for(engine, lambda h: h["waiting"] == 1, "the third request was not queued")
    queued.close()  # nothing was written to it yet: only polling its socket notices
    health = _wait_for(engine, lambda h: h["waiting"] == 0, "the queued request was not dropped", timeout=3)
    assert health["running"] == 2  # dropped while both slots were still busy: it never ran
    for sock in busy:
        sock.close()
    _wait_for(engine, lambda h: h["running"] == 0 and h["free_slots"] == 2, "the slots were not freed")


def test_a_waiting_request_gets_keepalive_lines(engine, monkeypatch) -> None:
    """A queued request is not silent for longer than KEEPALIVE_S: the API's read timeout (which marks an engine
    unhealthy) measures a hung engine, not a busy one."""
    monkeypatch.setattr(server_module, "KEEPALIVE_S", 0.3)
    _faults(monkeypatch, lambda i: False, delay_s=0.05)
    body = {"prompt_token_ids": PROMPT, "max_tokens": 100, "temperature": 0}
    busy = [_raw_request(engine.url, body) for _ in range(2)]
    _wait_for(engine, lambda h: h["running"] == 2, "the slots were not taken")
    queued = _raw_request(engine.url, body)
    reader = queued.makefile("rb")
    assert reader.readline().startswith(b"HTTP/1.1 200")  # the server's own version (RFC 9110), framed for 1.0
    while reader.readline() not in (b"\r\n", b""):
        pass  # the headers
    assert [json.loads(reader.readline())["type"] for _ in range(3)] == ["start", "keepalive", "keepalive"]
    assert engine.health().json()["waiting"] == 1  # still queued: the lines came while it waited
    reader.close()
    for sock in [queued, *busy]:
        sock.close()
    _wait_for(engine, lambda h: h["running"] == 0 and h["waiting"] == 0, "the slots were not freed")


def test_a_loop_that_keeps_failing_ends_the_job_and_its_endpoint(
    serve_model_dir, qwen_tokenizer_dir, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(batcher_module, "MAX_CRASHES", 2)
    monkeypatch.setattr(batcher_module, "RESTART_DELAY_S", 0.05)
    spec = {"load": str(serve_model_dir), "tokenizer_name_or_path": str(qwen_tokenizer_dir), "max_num_seqs": 1}
    eng = Engine(tmp_path, **spec, max_model_len=32)
    try:
        _faults(monkeypatch, lambda i: True)
        statuses = []
        for _ in range(2):
            status, lines = _post(eng.url, {"prompt_token_ids": PROMPT, "max_tokens": 2})
            statuses.append(status)
            assert lines[0]["error"]["type"] in ("engine_error", "engine_unavailable"), lines
        assert statuses == [500, 500]
        eng.thread.join(timeout=10)
        assert isinstance(eng.outcome.get("error"), LoopFailed), eng.outcome  # the job fails: retried by recovery
        assert "injected fault" in str(eng.outcome["error"])
        with pytest.raises(httpx.ConnectError):  # nothing listens for a dead loop
            eng.health()
    finally:
        eng.close()
