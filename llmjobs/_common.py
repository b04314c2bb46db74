"""What the sync and the async client share: configuration, URLs and query parameters of each call, the answer's
reading, the retry and reconnect decisions and the paging: each client adds only its I/O (``await`` or not)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypedDict
from urllib.parse import quote

import httpx

from llmjobs.errors import ApiConnectionError, error_from, unreachable
from llmjobs.types import StreamMessage

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


class JobFilters(TypedDict, total=False):
    """The filters of the job lists (``Client.jobs_page``, ``Client.list_jobs``); ``metadata``: every pair must match."""

    state: str | None
    kind: str | None
    name: str | None
    parent_id: str | None
    metadata: Mapping[str, str] | None


def job_filters(filters: JobFilters) -> dict[str, Any]:
    params: dict[str, Any] = {k: v for k, v in filters.items() if k != "metadata"}
    params.update({f"metadata[{k}]": v for k, v in (filters.get("metadata") or {}).items()})
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


def answer(response: httpx.Response) -> Any:
    """A (read) answer's JSON, or its typed error."""
    if response.status_code >= 400:
        raise error_from(response)
    return response.json()


def resend_delay(response: httpx.Response, retry: bool, attempt: int, max_retries: int) -> float | None:
    """Seconds before sending a request again after ``response``; None: it is final (not a "not now", not a request
    that may be resent, or ``max_retries`` spent)."""
    if retry and response.status_code in RETRY_STATUSES and attempt < max_retries:
        return retry_delay(response.headers, attempt)
    return None


def jobs_query(filters: JobFilters, after: str | None, limit: int) -> dict[str, Any]:
    """GET /v1/jobs's query: the filters, the page size and the cursor."""
    return {**job_filters(filters), "limit": limit, **({"after": after} if after else {})}


class Pages(NamedTuple):
    """A list the API answers page by page: GET ``path`` with ``params`` first, then the next page's query from each
    page's ``cursor`` field passed as ``param`` (``last_id`` as ``after``, ``next_offset`` as ``offset``) until a page
    says it has no more."""

    path: str
    params: dict[str, Any]
    param: str = "after"
    cursor: str = "last_id"

    def following(self, params: dict[str, Any], page: Mapping[str, Any]) -> dict[str, Any] | None:
        if not page["has_more"] or page[self.cursor] is None:
            return None
        return {**params, self.param: page[self.cursor]}


def events_pages(job_id: str, types: str | None, after: int, page_size: int) -> Pages:
    return Pages(
        job_path(job_id, "/events"), {"after": after, "limit": page_size, **({"type": types} if types else {})}
    )


def logs_pages(job_id: str, stream: str | None, rank: int | None, q: str | None, offset: int, page_size: int) -> Pages:
    params = {"offset": offset, "limit": page_size, **log_params(stream, rank, q)}
    return Pages(job_path(job_id, "/logs"), params, "offset", "next_offset")


def metrics_pages(job_id: str, names: str | None, page_size: int) -> Pages:
    params = {"limit": page_size, **({"names": names} if names else {})}
    return Pages(job_path(job_id, "/metrics"), params, "after", "next_cursor")


def files_pages(prefix: str | None, page_size: int) -> Pages:
    return Pages("/v1/files", {"limit": page_size, **({"prefix": prefix} if prefix else {})})


def upload_request(size: int, overwrite: bool) -> dict[str, Any]:
    """PUT /v1/files/{path} arguments but the body (each client streams it its own way)."""
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
    return {"timeout": None, "params": {"overwrite": str(overwrite).lower()}, "headers": headers}


@dataclass
class Resume:
    """A job's live stream across reconnections: the last event id seen (sent as ``Last-Event-ID``) and the failed
    connections in a row (at ``retries`` the next failure is raised)."""

    url: str
    job_id: str
    last_event_id: str | None
    retries: int
    failures: int = 0
    wait: Mapping[str, str] = field(default_factory=dict)  # the Retry-After of the last "not now" answer

    @property
    def path(self) -> str:
        return job_path(self.job_id, "/stream")

    def headers(self) -> dict[str, str]:
        return {"Last-Event-ID": self.last_event_id} if self.last_event_id else {}

    def refused(self, response: httpx.Response) -> None:
        """An error answer (read): raised, unless it is a "not now" with retries left (its Retry-After kept)."""
        if response.status_code not in RETRY_STATUSES or self.failures >= self.retries:
            raise error_from(response)
        self.wait = response.headers

    def message(self, event: str, data: str, event_id: str) -> StreamMessage | None:
        """The message of one Server-Sent Event; None for a keep-alive comment."""
        if not data:
            return None
        self.failures = 0
        self.last_event_id = event_id or self.last_event_id
        return StreamMessage(event or "message", json.loads(data), event_id or None)

    def lost(self, err: httpx.TransportError | None) -> float:
        """After a dropped connection (``err``), a closed stream without its end or a "not now": seconds before
        reconnecting, or the error once ``retries`` failed in a row."""
        if self.failures >= self.retries:
            if err is not None:
                raise unreachable(self.url, err) from err
            raise ApiConnectionError(f"the stream of {self.job_id} closed before its end message")
        delay = retry_delay(self.wait, self.failures)
        self.wait, self.failures = {}, self.failures + 1
        return delay
