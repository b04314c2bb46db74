"""A private PostgreSQL and a private Redis for outage tests, each on a random loopback port, which a test may stop
and start again. PostgreSQL: Debian's binaries, initdb in a temp dir, run as the ``postgres`` user when the tests run
as root. Redis: ``redis-server`` without persistence, so a restart also loses every message it held (the worst
case for a broker)."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from service_support import free_port


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        import pytest

        pytest.skip(f"no PostgreSQL server binaries (/usr/lib/postgresql/*/bin/{name})")
    return found[-1]


def _as_postgres(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@dataclass
class PrivatePostgres:
    data: Path
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.data.parent} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            _as_postgres(
                [_bin("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "-t", "60", "start"]
            ),
            check=True,
            capture_output=True,
        )

    def stop(self) -> None:
        subprocess.run(
            _as_postgres([_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"]),
            check=True,
            capture_output=True,
        )


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    root = Path(tempfile.mkdtemp(prefix="llmjobs-pg-"))
    root.chmod(0o755)
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    server = PrivatePostgres(root / "data", free_port(), root / "server.log")
    subprocess.run(
        _as_postgres([_bin("initdb"), "-D", str(server.data), "-A", "trust", "-U", "postgres", "--no-sync"]),
        check=True,
        capture_output=True,
    )
    server.start()
    try:
        yield server
    finally:
        subprocess.run(
            _as_postgres([_bin("pg_ctl"), "-D", str(server.data), "-m", "immediate", "stop"]), capture_output=True
        )
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class PrivateRedis:
    binary: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.log.parent),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"redis-server did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None


@contextmanager
def private_redis() -> Iterator[PrivateRedis]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(binary):
        import pytest

        pytest.skip("no redis-server binary (Debian: apt-get install redis-server)")
    root = Path(tempfile.mkdtemp(prefix="llmjobs-redis-"))
    server = PrivateRedis(binary, free_port(), root / "server.log")
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.proc.kill()
            server.proc.wait()
        shutil.rmtree(root, ignore_errors=True)
