"""A small HTTP client for the CLI: LLMJOBS_URL + LLMJOBS_TOKEN, errors shown as the API's {code, message, field}."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
from httpx_sse import connect_sse


class ClientError(Exception):
    """An API error answer (``status``, ``code``, ``field`` as the API gave them) or an unreachable server."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None, field: str | None = None):
        super().__init__(message)
        self.status, self.code, self.field = status, code, field


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0,
                 http: httpx.Client | None = None):
        self.url = (url or os.environ.get("LLMJOBS_URL") or "http://127.0.0.1:8000").rstrip("/")
        token = token or os.environ.get("LLMJOBS_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = http or httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise ClientError(f"cannot reach {self.url}: {err}") from err
        if response.status_code >= 400:
            raise _error(response)
        return response.json()

    def download(self, path: str, dest: str, params: dict[str, Any] | None = None) -> int:
        """Stream a download into the file ``dest``; returns the bytes written."""
        written = 0
        try:
            with self.http.stream("GET", path, params=params, timeout=None) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error(response)
                with open(dest, "wb") as out:
                    for chunk in response.iter_bytes():
                        written += out.write(chunk)
        except httpx.HTTPError as err:
            raise ClientError(f"cannot reach {self.url}: {err}") from err
        return written

    def stream(self, job_id: str, last_event_id: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event name, data) of the job's SSE stream until it ends (parsed by httpx-sse)."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        with connect_sse(self.http, "GET", f"/v1/jobs/{job_id}/stream", headers=headers, timeout=None) as source:
            if source.response.status_code >= 400:
                source.response.read()
                raise _error(source.response)
            for message in source.iter_sse():
                if message.data:  # a keep-alive comment ends a block with no data
                    yield message.event or "message", json.loads(message.data)


def _error(response: httpx.Response) -> ClientError:
    try:
        body = response.json()
        code, message, field = body.get("code"), body.get("message"), body.get("field")
    except ValueError:
        code, message, field = None, response.text, None
    detail = f"{code}: {message}" + (f" (field {field})" if field else "")
    if response.status_code == 401:
        detail += " — set LLMJOBS_TOKEN to a valid API token (an admin makes one with `llmjobs token create --team T`)"
    return ClientError(f"HTTP {response.status_code} {detail}", response.status_code, code, field)
