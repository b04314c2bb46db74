"""A private PostgreSQL for outage tests (Debian's binaries: initdb in a temp dir, a random loopback port), which a
test may stop and start again; the server runs as the ``postgres`` user when the tests run as root."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
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
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.log),
                                     "-w", "-t", "60", "start"]), check=True, capture_output=True)

    def stop(self) -> None:
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"]),
                       check=True, capture_output=True)


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    root = Path(tempfile.mkdtemp(prefix="llmjobs-pg-"))
    root.chmod(0o755)
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    server = PrivatePostgres(root / "data", free_port(), root / "server.log")
    subprocess.run(_as_postgres([_bin("initdb"), "-D", str(server.data), "-A", "trust", "-U", "postgres",
                                 "--no-sync"]), check=True, capture_output=True)
    server.start()
    try:
        yield server
    finally:
        subprocess.run(_as_postgres([_bin("pg_ctl"), "-D", str(server.data), "-m", "immediate", "stop"]),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
