"""The probe's three floods replayed against a real `llmjobs api` on 127.0.0.1 and PostgreSQL: team red opens 300
streams, starts 31 uploads that send 10 bytes and go idle, and submits 1,000 jobs; meanwhile team blue's reads
(``GET /v1/jobs``, ``/healthz``) keep a p99 under 1 s and never see a 5xx. Red is refused past its limits with 429 and
Retry-After; an idle upload is cut off by the body-read timeout and a half-sent request head by the header timeout."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from core_support import fresh_postgres_database, isolated_settings, make_token, team_dir
from service_support import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres]
STREAMS, UPLOADS, JOBS = 300, 31, 1000
LIMITS = {
    "LLMJOBS_TEAM_MAX_STREAMS": "20",
    "LLMJOBS_TEAM_MAX_UPLOADS": "4",
    "LLMJOBS_TEAM_MAX_ACTIVE_JOBS": "100",
    "LLMJOBS_BODY_READ_TIMEOUT_S": "6",
    "LLMJOBS_HEADER_TIMEOUT_S": "2",
}
SPEC = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "out/x"}


@dataclass
class Api:
    url: str
    red: str
    blue: str
    port: int
    red_job: str = ""  # submitted at start, before the jobs flood can fill red's active-jobs limit (any test order)


@pytest.fixture(scope="module")
def api(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    var = tmp_path_factory.mktemp("floods")
    with fresh_postgres_database(postgres_url, migrated=True) as url:
        settings = isolated_settings(var, url)
        for team in ("red", "blue"):
            (team_dir(settings, team) / "in.jsonl").write_text('{"text": "hi"}\n')
            (team_dir(settings, team) / "tok").mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMJOBS_")}
        port = free_port()
        env.update(LLMJOBS_VAR_DIR=str(var), LLMJOBS_DATABASE_URL=url, LLMJOBS_PORT=str(port), **LIMITS)
        env.update(LLMJOBS_RECONCILE_INTERVAL_S="3600", LLMJOBS_LOG_LEVEL="WARNING")
        with open(var / "api.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "api"], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(base, proc, var / "api.log")
            ready = Api(base, make_token(settings, "red"), make_token(settings, "blue"), port)
            yield dataclasses.replace(ready, red_job=_red_job(ready))
        finally:
            proc.terminate()
            proc.wait(30)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(log.read_text()[-3000:])


@dataclass
class Reads:
    """Blue's reads while a flood runs: latencies in seconds and status codes (0: no answer in 15 s)."""

    seconds: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    def p99(self) -> float:
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]

    def summary(self) -> str:
        errors = sum(s == 0 or s >= 500 for s in self.statuses)
        return (
            f"{len(self.seconds)} reads, p99 {self.p99():.3f} s, max {max(self.seconds):.3f} s, {errors} 5xx/timeouts"
        )


def _blue_reads(api: Api, seconds: float) -> Reads:
    reads = Reads()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {api.blue}"}, timeout=15) as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for path in ("/v1/jobs", "/healthz"):
                start = time.monotonic()
                try:
                    reads.statuses.append(client.get(path).status_code)
                except httpx.TimeoutException:
                    reads.statuses.append(0)
                reads.seconds.append(time.monotonic() - start)
            time.sleep(0.02)
    return reads


def _check(reads: Reads, flood: str) -> None:
    print(f"{flood}: blue {reads.summary()}")
    assert all(0 < s < 500 for s in reads.statuses), f"{flood}: {reads.summary()}"
    assert reads.p99() < 1.0, f"{flood}: {reads.summary()}"


def _open(api: Api, head: str, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", api.port), timeout=30)
    sock.sendall(head.encode() + b"\r\n" + body)
    return sock


def _status(sock: socket.socket, wait: float) -> tuple[int, bytes]:
    """The status of the answer on ``sock`` (0: none within ``wait``), and its head."""
    sock.settimeout(wait)
    try:
        head = sock.recv(4096)
    except OSError:
        return 0, b""
    return (int(head.split()[1]) if head.startswith(b"HTTP/1.1") else -1), head


def _red_job(api: Api) -> str:
    answer = httpx.post(f"{api.url}/v1/jobs", json=SPEC, headers={"Authorization": f"Bearer {api.red}"}, timeout=30)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def test_open_streams_flood(api: Api) -> None:
    job = api.red_job  # queued with no worker: its stream stays open
    head = f"GET /v1/jobs/{job}/stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api.red}\r\n"
    socks = [_open(api, head) for _ in range(STREAMS)]
    try:
        statuses = [_status(s, 30)[0] for s in socks]  # every stream answered: the allowed ones stay open
        reads = _blue_reads(api, 5)
        print(f"streams: red got {statuses.count(200)} x 200, {statuses.count(429)} x 429, {statuses.count(0)} none")
        _check(reads, "300 open streams")
        assert statuses.count(200) == int(LIMITS["LLMJOBS_TEAM_MAX_STREAMS"])
        assert statuses.count(429) == STREAMS - statuses.count(200)
    finally:
        for sock in socks:
            sock.close()


def test_slow_uploads_flood(api: Api) -> None:
    head = "PUT /v1/files/slow/{}.bin HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Length: 100000000\r\n"
    socks = [_open(api, head.format(i, api.red), b"0123456789") for i in range(UPLOADS)]
    half_head = _open(api, "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: 1")  # a head that never ends
    try:
        reads = _blue_reads(api, 4)  # while the allowed uploads sit idle
        answers = [_status(s, 10) for s in socks]
        statuses = [status for status, _ in answers]
        print(f"uploads: red got {statuses.count(429)} x 429, {statuses.count(408)} x 408, {statuses.count(0)} none")
        _check(reads, "31 slow uploads")
        limit = int(LIMITS["LLMJOBS_TEAM_MAX_UPLOADS"])
        assert statuses.count(429) == UPLOADS - limit
        assert statuses.count(408) == limit  # cut off by the body-read timeout
        assert all(b"retry-after" in head.lower() for status, head in answers if status == 429)
        half_head.settimeout(10)
        assert half_head.recv(4096) == b""  # the header timeout closed it
    finally:
        for sock in [*socks, half_head]:
            sock.close()


def test_queued_jobs_flood(api: Api) -> None:
    statuses: list[int] = []
    red = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {api.red}"}, timeout=60)

    def flood() -> None:
        with red, ThreadPoolExecutor(8) as pool:
            statuses.extend(pool.map(lambda _: red.post("/v1/jobs", json=SPEC).status_code, range(JOBS)))

    flooding = threading.Thread(target=flood)
    flooding.start()
    reads = _blue_reads(api, 6)
    flooding.join()
    print(f"jobs: red got {statuses.count(201)} x 201, {statuses.count(429)} x 429")
    _check(reads, "1,000 queued jobs")
    limit = int(LIMITS["LLMJOBS_TEAM_MAX_ACTIVE_JOBS"])
    assert statuses.count(201) == limit - 1  # red's job queued at start counts too
    assert statuses.count(429) == JOBS - statuses.count(201)
    blue = httpx.post(f"{api.url}/v1/jobs", json=SPEC, headers={"Authorization": f"Bearer {api.blue}"}, timeout=30)
    assert blue.status_code == 201, blue.text
