"""The OpenAI routes' way to the engines: one pooled HTTP client per engine URL, timeouts, and a short memory of the
engines that stopped answering.

- Clients: an ``httpx.AsyncClient`` costs ~23 ms to build (its TLS context), so each engine URL gets one, made on first
  use and shared by every request to it. The engine speaks HTTP/1.1 with keep-alive (``engine.serve.server``): a
  client keeps up to ``KEEPALIVE_CONNECTIONS`` idle connections for ``KEEPALIVE_S`` (under the engine's own idle
  limit, so this side always closes first and never reuses a connection the engine is closing), and a request reuses
  one instead of connecting. It has no cap on open connections: the per-team request limit
  (``settings.team_max_chat_requests``) bounds what one team opens, and the engine queues or refuses (429) the rest.
  A request given up before its answer ended (its client left) closes its connection, which is how the engine learns
  to cancel it.
- Closing: every client on the app's shutdown (the router's lifespan, ``aclose``); and, at most every ``PRUNE_S``, the
  clients of URLs that no ready deployment has any more (a job that ended, a restarted attempt on a new port).
- Timeouts: connect 5 s; read ``settings.engine_read_timeout_s``: the most silence allowed before the engine's answer
  and between two of its lines (a long generation streams a line per token, so it never trips this).
- Unhealthy: an engine that refuses the connection or times out is marked for ``settings.engine_unhealthy_ttl_s``:
  ``GET /v1/models`` leaves it out and its requests get 503 ``model_not_ready`` at once (no pile-up of clients waiting
  on a hung engine); after the TTL the next request tries it again, and an answer clears the mark. The mark lives in
  this replica's memory only; the job's own state stays the worker's business (an engine process that dies ends its
  job, and recovery retries it).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx

from app.openai_format import OpenAIError
from core.db import session_scope
from core.deployments import Deployment, ready_urls
from core.settings import Settings
from engine.contract.serve_request import ServeRequest

log = logging.getLogger(__name__)
PRUNE_S = 60.0  # how often the clients of deployments that went away are closed
CONNECT_S, WRITE_S = 5.0, 30.0
KEEPALIVE_CONNECTIONS = 256  # idle connections kept per engine: a burst's worth, each holds an engine thread
KEEPALIVE_S = 30.0  # an idle connection's life here (the engine closes its side after engine.serve.server.IDLE_S)


class EngineProxy:
    def __init__(self, settings: Settings, prune_s: float = PRUNE_S):
        self.settings, self.prune_s = settings, prune_s
        self.timeout = httpx.Timeout(connect=CONNECT_S, read=settings.engine_read_timeout_s, write=WRITE_S, pool=None)
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._down_until: dict[str, float] = {}
        self._pruned_at = time.monotonic()

    def healthy(self, url: str) -> bool:
        return self._down_until.get(url, 0.0) <= time.monotonic()

    def mark_down(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + self.settings.engine_unhealthy_ttl_s

    def not_answering(self, dep: Deployment) -> OpenAIError:
        """The 503 of a deployment whose engine does not answer (Retry-After: the rest of its unhealthy mark)."""
        left = max(1, math.ceil(self._down_until.get(dep.url or "", 0.0) - time.monotonic()))
        message = f"deployment {dep.name!r} is not answering; retry later"
        return OpenAIError(503, message, "model", "model_not_ready", **{"Retry-After": str(left)})

    def urls(self) -> list[str]:
        """The engine URLs this replica holds a client for."""
        return sorted(self._clients)

    def client(self, url: str) -> httpx.AsyncClient:
        """The one client of ``url``, made on first use."""
        client = self._clients.get(url)
        if client is None:
            limits = httpx.Limits(
                max_connections=None, max_keepalive_connections=KEEPALIVE_CONNECTIONS, keepalive_expiry=KEEPALIVE_S
            )
            client = self._clients[url] = httpx.AsyncClient(timeout=self.timeout, limits=limits)
        return client

    async def open(self, dep: Deployment, generation: ServeRequest) -> EngineStream:
        """POST ``generation`` to the deployment's engine; its answer's lines once it says 200, else an OpenAIError."""
        assert dep.url is not None, "only a ready deployment is proxied"
        await self._prune()
        if not self.healthy(dep.url):
            raise self.not_answering(dep)
        client = self.client(dep.url)
        with self._reaching(dep):
            request = client.build_request("POST", f"{dep.url}/v1/generate", json=generation.to_json())
            response = await client.send(request, stream=True)
        if response.status_code != 200:
            raw = await response.aread()
            await response.aclose()
            if response.status_code == 503:  # an engine that says it cannot serve (its loop is down)
                self.mark_down(dep.url)
                raise self.not_answering(dep)
            raise engine_error(response, raw)
        self._down_until.pop(dep.url, None)
        return EngineStream(self, dep, response)

    async def call(
        self, dep: Deployment, method: str, path: str, payload: dict[str, Any] | None = None
    ) -> httpx.Response:
        """One short exchange with the deployment's engine (``/tokenize``, ``/metrics``): its answer when it says 200,
        else the OpenAIError to answer; a silent or refusing engine is marked as ``open`` marks it."""
        assert dep.url is not None, "only a ready deployment is asked"
        if not self.healthy(dep.url):
            raise self.not_answering(dep)
        with self._reaching(dep):
            response = await self.client(dep.url).request(method, f"{dep.url}{path}", json=payload)
        if response.status_code != 200:
            raise engine_error(response, response.content)
        return response

    @contextmanager
    def _reaching(self, dep: Deployment) -> Iterator[None]:
        """Around an exchange with ``dep``'s engine: a silent one is marked down and answered 503 (``not_answering``),
        any other transport error is a 502."""
        assert dep.url is not None, "only a ready deployment is reached"
        try:
            yield
        except (httpx.TimeoutException, httpx.NetworkError) as err:
            log.warning("deployment %s at %s: %r; marked unhealthy", dep.name, dep.url, err)
            self.mark_down(dep.url)
            raise self.not_answering(dep) from err
        except httpx.HTTPError as err:
            raise OpenAIError(502, f"deployment {dep.name!r}: {err}", None, "engine_error") from err

    async def _prune(self) -> None:
        if time.monotonic() - self._pruned_at < self.prune_s:
            return
        self._pruned_at = time.monotonic()
        known = set(self._clients)  # before the look-up: a client made meanwhile is for a URL just found ready
        live = await anyio.to_thread.run_sync(_ready_urls, self.settings.database_url)
        for url in known - live:
            await self._clients.pop(url).aclose()
            self._down_until.pop(url, None)

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()


def _ready_urls(database_url: str) -> set[str]:
    with session_scope(database_url) as session:
        return ready_urls(session)


class EngineStream:
    """One engine answer being read: its JSON lines, then ``aclose`` (which makes the engine cancel what is left)."""

    def __init__(self, proxy: EngineProxy, dep: Deployment, response: httpx.Response):
        self.proxy, self.dep, self.response = proxy, dep, response

    async def lines(self) -> AsyncIterator[dict[str, Any]]:
        """The engine's lines up to ``done``; an OpenAIError when it goes silent, breaks off or reports an error."""
        done = False
        try:
            async for raw in self.response.aiter_lines():
                line = json.loads(raw) if raw else None
                if line is not None:
                    _raise_if_error(line)
                    done = line.get("type") == "done"
                    yield line
        except httpx.TimeoutException as err:
            log.warning("deployment %s at %s went silent; marked unhealthy", self.dep.name, self.dep.url)
            self.proxy.mark_down(self.dep.url or "")
            raise self.proxy.not_answering(self.dep) from err
        except (httpx.HTTPError, ValueError) as err:
            message = f"deployment {self.dep.name!r}: its answer broke off: {err}"
            raise OpenAIError(502, message, None, "engine_error") from err
        if not done:  # an answer that ended without its last line (an HTTP/1.0 engine that died mid-answer)
            raise OpenAIError(502, f"deployment {self.dep.name!r}: its answer ended early", None, "engine_error")

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):  # even when the request is being cancelled: the engine must see the close
            await self.response.aclose()


def _raise_if_error(line: dict[str, Any]) -> None:
    """An engine's in-stream error line (its generation failed after the answer began) as an OpenAIError."""
    if line.get("type") != "error":
        return
    nested = line.get("error")
    error: dict[str, Any] = nested if isinstance(nested, dict) else line
    message = str(error.get("message") or "the engine failed this request")
    raise OpenAIError(500, message, error.get("field"), error.get("type") or "engine_error")


def engine_error(response: httpx.Response, raw: bytes) -> OpenAIError:
    """An engine's refusal (before any line) as the OpenAIError to answer."""
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": f"engine answered {response.status_code}", "field": None}
    if response.status_code == 429:
        retry = response.headers.get("Retry-After", "1")
        return OpenAIError(429, error["message"], None, "queue_full", **{"Retry-After": retry})
    if response.status_code == 404:  # an adapter the engine does not hold (its spec changed under it)
        return OpenAIError(404, error["message"], "model", "model_not_found")
    status = response.status_code if response.status_code in (400, 500) else 502  # 500: it failed this request
    return OpenAIError(status, error["message"], error.get("field"), error.get("type"))
