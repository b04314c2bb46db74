"""A small HTTP client for the CLI: LLMJOBS_URL + LLMJOBS_TOKEN, errors shown as the API's {code, message, field}."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx


class ClientError(Exception):
    pass


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0):
        self.url = (url or os.environ.get("LLMJOBS_URL") or "http://127.0.0.1:8000").rstrip("/")
        token = token or os.environ.get("LLMJOBS_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as err:
            raise ClientError(f"cannot reach {self.url}: {err}") from err
        if response.status_code >= 400:
            try:
                body = response.json()
                detail = f"{body.get('code')}: {body.get('message')}" + (f" (field {body['field']})" if body.get("field") else "")
            except ValueError:
                detail = response.text
            raise ClientError(f"HTTP {response.status_code} {detail}")
        return response.json()

    def stream(self, job_id: str, last_event_id: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event name, data) of the job's SSE stream until it ends."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        with self.http.stream("GET", f"/v1/jobs/{job_id}/stream", headers=headers, timeout=None) as response:
            if response.status_code >= 400:
                response.read()
                raise ClientError(f"HTTP {response.status_code} {response.text}")
            yield from parse_sse(response.iter_lines())


def parse_sse(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    event, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
