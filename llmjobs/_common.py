"""What the sync and the async client share: configuration, URLs and query parameters of each call."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

DEFAULT_URL = "http://127.0.0.1:8000"
CHUNK = 1 << 20
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)
# Answers meaning "not now": the API's 503 while its database is away (with Retry-After), a proxy's 502/504.
RETRY_STATUSES = frozenset({502, 503, 504})
MAX_RETRY_AFTER_S = 60.0


def may_retry(method: str, headers: Mapping[str, str] | None) -> bool:
    """Whether a request may be sent again after a "not now" answer: reads, and writes with an Idempotency-Key (the
    server answers a replay with the first result)."""
    return method.upper() in ("GET", "HEAD") or any(k.lower() == "idempotency-key" for k in (headers or {}))


def retry_delay(headers: Mapping[str, str], attempt: int) -> float:
    """Seconds before retry ``attempt`` (0-based): the answer's ``Retry-After`` in seconds (at most
    ``MAX_RETRY_AFTER_S``), else the backoff table."""
    try:
        seconds = float(headers.get("retry-after", ""))
    except ValueError:  # absent, or an HTTP date
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:  # "nan" or "-1" from a broken proxy: the table
        return RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]
    return min(seconds, MAX_RETRY_AFTER_S)


def base_url(url: str | None) -> str:
    return (url or os.environ.get("LLMJOBS_URL") or DEFAULT_URL).rstrip("/")


def auth_headers(token: str | None) -> dict[str, str]:
    token = token or os.environ.get("LLMJOBS_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def spec_request(spec: Mapping[str, Any] | str | bytes, idempotency_key: str | None) -> dict[str, Any]:
    """POST /v1/jobs arguments: a mapping is sent as JSON, text as it is (the server reports its JSON errors)."""
    content = spec if isinstance(spec, str | bytes) else json.dumps(spec)
    headers = {"Content-Type": "application/json", **({"Idempotency-Key": idempotency_key} if idempotency_key else {})}
    return {"content": content, "headers": headers}


def job_filters(
    state: str | None, kind: str | None, name: str | None, parent_id: str | None, metadata: Mapping[str, str] | None
) -> dict[str, Any]:
    params: dict[str, Any] = {"state": state, "kind": kind, "name": name, "parent_id": parent_id}
    params.update({f"metadata[{k}]": v for k, v in (metadata or {}).items()})
    return {k: v for k, v in params.items() if v is not None}


def log_params(stream: str | None, rank: int | None, q: str | None) -> dict[str, Any]:
    return {k: v for k, v in {"stream": stream, "rank": rank, "q": q}.items() if v is not None}


def job_path(job_id: str, tail: str = "") -> str:
    return f"/v1/jobs/{quote(job_id, safe='')}{tail}"


def download_path(job_id: str, name: str) -> str:
    return job_path(job_id, f"/artifacts/{quote(name, safe='')}/download")


def file_path(path: str) -> str:
    return f"/v1/files/{quote(path.strip('/'), safe='/')}"


def tree(local_dir: Path) -> Iterator[tuple[Path, str]]:
    """(file, path relative to ``local_dir``) of every regular file under it, links left out, sorted."""
    for file in sorted(local_dir.rglob("*")):
        if file.is_file() and not file.is_symlink():
            yield file, file.relative_to(local_dir).as_posix()


def join(prefix: str | None, rel: str) -> str:
    return f"{prefix.strip('/')}/{rel}" if prefix else rel
