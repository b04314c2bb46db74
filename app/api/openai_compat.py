"""OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``; vLLM's
``POST /tokenize`` and ``POST /detokenize`` (at the root, as vLLM serves them) and ``GET /v1/metrics`` (the team's
deployments' Prometheus metrics under vLLM's names, ``engine.serve.prom``).

The request path (``docs/serving.md``): authenticate the team token (``request.state.principal`` when the auth
middleware set it, else looked up here) BEFORE the body is read; take one of the team's request slots on this replica
(``settings.team_max_chat_requests``, else 429 with Retry-After); read and type-check the body (``app.openai_format``:
a wrong type is a 400 naming the field, before anything reaches an engine); find the caller's team's deployment named
by ``model`` (``core.deployments``: another team's reads as missing, 404; one not ready yet is 503; a ready one is
remembered a few seconds, ``app.lookup_cache``, and looked up afresh when its engine refuses); POST it to the
engine's own endpoint through this replica's pooled client for that URL (``app.engine_proxy``: connect and read
timeouts, a silent or refusing engine is 503 ``model_not_ready`` and left out of ``/v1/models`` for a while) and
stream the engine's JSON lines back as OpenAI objects, or SSE chunks ending ``data: [DONE]`` (an error after the
stream began is one ``data: {"error": ...}`` event, then the end). A client that disconnects, streaming or not, closes
the upstream answer, and the engine cancels its sequences; the slot is given back however the request ends. Every
error on these routes has OpenAI's shape. Database look-ups run in worker threads, never on the event loop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Annotated, Any, TypeVar

import anyio
import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import Receive, Scope, Send

from app import lookup_cache
from app.api.deps import SettingsDep
from app.engine_proxy import EngineProxy, EngineStream
from app.openai_format import (
    OpenAIError,
    ReasoningSplitter,
    chat_logprobs,
    chat_request,
    chunk,
    completion_request,
    include_usage,
    new_id,
    split_tool_calls,
    sse,
    structured_origin,
    tool_mode,
    wants_stream,
)
from app.openai_metrics import merged_exposition
from app.openai_tools import ToolCallStream
from app.team_slots import TeamSlots
from core.auth import Principal, authenticate
from core.db import get_sessionmaker
from core.deployments import Deployment, find_deployment, list_deployments
from core.errors import ApiError
from core.settings import Settings
from engine.contract.serve_request import ServeRequest

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class Serving:
    """What the OpenAI routes keep per app: the engine clients and the per-team request slots."""

    proxy: EngineProxy
    slots: TeamSlots


def _serving(app: FastAPI) -> Serving:
    serving: Serving | None = getattr(app.state, "openai_serving", None)
    if serving is None:  # at startup (the router's lifespan), or at first use in an app run without it
        settings: Settings = app.state.settings
        slots = TeamSlots("chat requests", settings.team_max_chat_requests, settings.team_limit_retry_after_s)
        serving = app.state.openai_serving = Serving(EngineProxy(settings), slots)
    return serving


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    serving = _serving(app)
    yield
    await serving.proxy.aclose()  # the engine clients go with the app


router = APIRouter(prefix="/v1", tags=["openai"], lifespan=_lifespan)
root_router = APIRouter(tags=["openai"])  # vLLM's /tokenize and /detokenize sit at the root
_bearer = HTTPBearer(auto_error=False, description="A team token: pass it as the openai client's api_key.")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _error(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


def _with_session(settings: Settings, work: Callable[[Any], T]) -> T:
    with get_sessionmaker(settings.database_url)() as session:
        return work(session)


def _principal(session: Any, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise OpenAIError(401, "missing bearer token (the openai client's api_key: a team token)", None, "unauthorized")
    principal = authenticate(session, credentials.credentials)
    if principal is None:
        raise OpenAIError(401, "invalid or revoked token", None, "invalid_api_key")
    return principal


async def _caller(request: Request, settings: Settings, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    """The caller, checked before anything of the body is read: the auth middleware's, else looked up here."""
    principal = getattr(request.state, "principal", None)
    if isinstance(principal, Principal):
        return principal
    return await anyio.to_thread.run_sync(_with_session, settings, lambda s: _principal(s, credentials))


def _take_slot(slots: TeamSlots, team: str) -> None:
    try:
        slots.acquire(team)
    except ApiError as err:  # the same limit as the other per-team slots, answered in OpenAI's shape
        raise OpenAIError(429, err.message, None, "too_many_requests", **(err.headers or {})) from err


async def _on_deployment(
    settings: Settings, principal: Principal, model: str, use: Callable[[Deployment], Awaitable[T]]
) -> tuple[Deployment, T]:
    """``use`` on the ready deployment ``model`` names. A remembered one whose engine refuses (503: stopped, moved to
    a new attempt) or lacks the adapter (404) is forgotten and looked up again, so the answer is the database's."""
    key = lookup_cache.deployment_key(settings.database_url, principal, model)
    dep, remembered = await _ready(settings, principal, model, key)
    try:
        return dep, await use(dep)
    except OpenAIError as err:
        if not remembered or err.status not in (404, 503):
            raise
    lookup_cache.DEPLOYMENTS.discard(key)
    dep, _ = await _ready(settings, principal, model, key)
    return dep, await use(dep)


async def _ready(
    settings: Settings, principal: Principal, model: str, key: tuple[str, str, bool, str]
) -> tuple[Deployment, bool]:
    """The ready deployment, and whether it was remembered; an OpenAIError when it is missing or not ready."""
    dep, remembered = await lookup_cache.DEPLOYMENTS.remembered(
        key,
        lambda: _with_session(settings, lambda s: find_deployment(s, principal, model)),
        keep=lambda d: d.ready,
    )
    if dep is None:
        raise OpenAIError(404, f"model: no deployment {model!r} (see GET /v1/models)", "model", "model_not_found")
    if not dep.ready:
        raise OpenAIError(
            503,
            f"deployment {model!r} is {dep.state}, not ready yet",
            "model",
            "model_not_ready",
            **{"Retry-After": "5"},
        )
    return dep, remembered


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as err:
        raise OpenAIError(400, f"body: not JSON: {err}", None, "invalid_json") from err
    if not isinstance(body, dict):
        raise OpenAIError(400, "body: must be a JSON object", None, "invalid_json")
    return body


async def _unless_client_leaves(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, ``work``'s result), or (False, None) when the client disconnected first: ``work`` is cancelled then."""
    done: list[T] = []
    failed: list[OpenAIError] = []
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":  # the body is read: only this can come
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            done.append(await work)
        except OpenAIError as err:  # kept out of the task group's exception group
            failed.append(err)
        group.cancel_scope.cancel()
    if failed:
        raise failed[0]
    return (True, done[0]) if done else (False, None)


class _HeldStream(StreamingResponse):
    """An SSE answer that gives back what it holds (the engine's answer, the team's slot) however it ends: the body
    may never be iterated when the client left before it started."""

    def __init__(self, content: AsyncIterator[bytes], release: Callable[[], Awaitable[Any]]):
        super().__init__(content, media_type="text/event-stream")
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._release()


# ------------------------------------------------------------------ routes


@router.get("/models")
async def models(request: Request, settings: SettingsDep, credentials: Credentials) -> JSONResponse:
    """The caller's team's ready deployments and their LoRA adapters, as OpenAI's model list (an engine that stopped
    answering is left out for a while, see ``app.engine_proxy``)."""
    try:
        principal = await _caller(request, settings, credentials)
        deps = await anyio.to_thread.run_sync(_with_session, settings, lambda s: list_deployments(s, principal))
    except OpenAIError as err:
        return _error(err)
    proxy = _serving(request.app).proxy
    listed = [d for d in deps if d.ready and proxy.healthy(d.url or "")]
    return JSONResponse({"object": "list", "data": [m for d in listed for m in _model_objects(d)]})


def _model_objects(dep: Deployment) -> list[dict[str, Any]]:
    """OpenAI model objects of a deployment: its base, then each LoRA adapter with the base as ``parent`` (vLLM's
    ``root`` / ``parent`` convention: the path each was loaded from, the model an adapter applies to)."""
    common = {"object": "model", "created": dep.created, "owned_by": dep.team, "job_id": dep.job_id}
    base = {"id": dep.name, **common, "root": dep.root, "parent": None}
    return [base, *({"id": n, **common, "root": path, "parent": dep.name} for n, path in dep.adapters.items())]


@router.post("/chat/completions", response_model=None)
async def chat_completions(request: Request, settings: SettingsDep, credentials: Credentials) -> Response:
    """OpenAI's chat completions on a deployment (``model``): Qwen3 chat template, thinking as reasoning_content."""
    return await _complete(request, settings, credentials, "chat")


@router.post("/completions", response_model=None)
async def completions(request: Request, settings: SettingsDep, credentials: Credentials) -> Response:
    """OpenAI's (legacy) text completions on a deployment (``model``): the prompt is tokenized as it is."""
    return await _complete(request, settings, credentials, "text")


async def _complete(
    request: Request, settings: Settings, credentials: HTTPAuthorizationCredentials | None, kind: str
) -> Response:
    try:
        principal = await _caller(request, settings, credentials)  # before the body is read
        serving = _serving(request.app)
        async with AsyncExitStack() as held:
            _take_slot(serving.slots, principal.team)
            held.callback(serving.slots.release, principal.team)
            body = await _body(request)
            generation = chat_request(body) if kind == "chat" else completion_request(body)
            dep, upstream = await _on_deployment(
                settings, principal, body["model"], lambda d: _open(serving, d, generation, body)
            )
            held.push_async_callback(upstream.aclose)
            rid, model = new_id("chatcmpl" if kind == "chat" else "cmpl"), dep.adapter or dep.name
            n, tools = generation.options.n, kind == "chat" and tool_mode(body) != "none"
            if wants_stream(body):  # the response holds the slot and the upstream answer from here
                lines = _stream(kind, upstream, rid, model, n, include_usage(body), tools)
                return _HeldStream(lines, held.pop_all().aclose)
            stayed, answer = await _unless_client_leaves(request, _collect(kind, upstream, rid, model, n, tools))
    except OpenAIError as err:
        return _error(err)
    return JSONResponse(answer) if stayed else Response(status_code=499)  # 499: nobody is left to read it


async def _open(serving: Serving, dep: Deployment, generation: ServeRequest, body: dict[str, Any]) -> EngineStream:
    if dep.adapter is not None:  # the engine applies this adapter to the request's sequences
        generation = dataclasses.replace(generation, model=dep.adapter)
    try:
        return await serving.proxy.open(dep, generation)
    except OpenAIError as err:
        if err.param == "structured":  # the engine's name for the grammar: answer with the field it came from
            err.param = structured_origin(body)
            err.message = f"{err.param}: {err.message.split(': ', 1)[-1]}"
        raise


# ------------------------------------------------------------------ tokens and metrics


@root_router.post("/tokenize", response_model=None)
async def tokenize(request: Request, settings: SettingsDep, credentials: Credentials) -> Response:
    """vLLM's ``/tokenize``: ``{"model", "messages" | "prompt", "chat_template_kwargs", "tools"}`` to ``{"count",
    "max_model_len", "tokens"}``, with the deployment's own tokenizer and chat template."""
    return await _tokens(request, settings, credentials, "/tokenize")


@root_router.post("/detokenize", response_model=None)
async def detokenize(request: Request, settings: SettingsDep, credentials: Credentials) -> Response:
    """vLLM's ``/detokenize``: ``{"model", "tokens"}`` to ``{"prompt"}``."""
    return await _tokens(request, settings, credentials, "/detokenize")


async def _tokens(request: Request, settings: Settings, credentials: Any, path: str) -> Response:
    try:
        principal = await _caller(request, settings, credentials)
        serving = _serving(request.app)
        _take_slot(serving.slots, principal.team)  # the engine's handler threads are shared: the same per-team bound
        try:
            return await _tokens_of(request, settings, principal, serving, path)
        finally:
            serving.slots.release(principal.team)
    except OpenAIError as err:
        return _error(err)


async def _tokens_of(
    request: Request, settings: Settings, principal: Principal, serving: Serving, path: str
) -> Response:
    try:
        body = await _body(request)
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise OpenAIError(400, "model: required (a deployment's name, see GET /v1/models)", "model")

        def ask(dep: Deployment) -> Awaitable[httpx.Response]:
            base = {k: v for k, v in body.items() if k != "model"}
            return serving.proxy.call(
                dep, "POST", path, base if dep.adapter is None else {**body, "model": dep.adapter}
            )

        _, answer = await _on_deployment(settings, principal, body["model"], ask)
    except OpenAIError as err:
        return _error(err)
    return JSONResponse(answer.json())


@router.get("/metrics", response_class=Response)
async def deployment_metrics(request: Request, settings: SettingsDep, credentials: Credentials) -> Response:
    """The caller's team's ready deployments' Prometheus metrics under vLLM's names (``vllm:num_requests_running``,
    ``vllm:time_to_first_token_seconds``, ...), each sample labelled ``deployment`` and ``model_name`` (the base or
    the LoRA adapter); an engine that does not answer is left out."""
    try:
        principal = await _caller(request, settings, credentials)
        deps = await anyio.to_thread.run_sync(_with_session, settings, lambda s: list_deployments(s, principal))
    except OpenAIError as err:
        return _error(err)
    proxy, texts = _serving(request.app).proxy, []
    for dep in deps:
        if dep.ready and dep.adapter is None and proxy.healthy(dep.url or ""):
            try:
                texts.append((await proxy.call(dep, "GET", "/metrics")).text)
            except OpenAIError:
                log.info("deployment %s: no metrics (not answering)", dep.name)
    return Response(merged_exposition(texts), media_type="text/plain; version=0.0.4; charset=utf-8")


# ------------------------------------------------------------------ streaming


async def _stream(
    kind: str, upstream: EngineStream, rid: str, model: str, n: int, usage: bool, tools: bool
) -> AsyncIterator[bytes]:
    try:
        async for chunk_bytes in _chunks(kind, upstream, rid, model, n, usage, tools):
            yield chunk_bytes
    except OpenAIError as err:  # the 200 is sent: the error is the stream's last event (the openai client raises it)
        yield sse(err.body())
        return
    yield sse("[DONE]")


async def _chunks(
    kind: str, upstream: EngineStream, rid: str, model: str, n: int, include_usage: bool, tools: bool
) -> AsyncIterator[bytes]:
    splitters = [ReasoningSplitter() for _ in range(n)]
    calls = [ToolCallStream() if tools else None for _ in range(n)]
    started: set[int] = set()
    async for line in upstream.lines():
        if line["type"] in ("token", "finish"):
            i, final = line["index"], line["type"] == "finish"
            if kind == "chat":
                choices = _chat_deltas(line, splitters[i], calls[i], i not in started)
            else:
                choices = [c for c in [_text_delta(line)] if c is not None]
            started.add(i)
            if final and not choices:
                choices = [{"index": i, "logprobs": None}]
            for k, choice in enumerate(choices):
                if kind == "chat":
                    choice.setdefault("delta", {})
                else:
                    choice.setdefault("text", "")
                last = final and k == len(choices) - 1
                choice["finish_reason"] = _reason(line["finish_reason"], calls[i]) if last else None
                yield sse(chunk(kind, rid, model, [choice]))
        elif line["type"] == "done" and include_usage:
            yield sse(chunk(kind, rid, model, [], usage=line["usage"]))


def _reason(reason: str, calls: ToolCallStream | None) -> str:
    return "tool_calls" if calls is not None and calls.calls and reason == "stop" else reason


def _chat_deltas(
    line: dict[str, Any], splitter: ReasoningSplitter, calls: ToolCallStream | None, first: bool
) -> list[dict[str, Any]]:
    """The chunks' choices of one engine line: its reasoning / content delta, then one per tool-call delta."""
    final = line["type"] == "finish"
    reasoning, content = splitter.push(line.get("text", ""), final=final)
    tool_deltas: list[dict[str, Any]] = []
    if calls is not None:
        content, tool_deltas = calls.push(content, final=final)
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    lp = chat_logprobs(line) if line["type"] == "token" else None
    out = [{"index": line["index"], "delta": delta, "logprobs": {"content": [lp]} if lp else None}]
    if not delta and lp is None:
        out = []
    out += [{"index": line["index"], "delta": {"tool_calls": [d]}, "logprobs": None} for d in tool_deltas]
    return out


def _text_delta(line: dict[str, Any]) -> dict[str, Any] | None:
    text = line.get("text", "")
    if line["type"] != "token" or (not text and "logprob" not in line):
        return None
    return {"index": line["index"], "text": text, "logprobs": _text_logprobs([line]) if "logprob" in line else None}


def _text_logprobs(lines: list[dict[str, Any]]) -> dict[str, Any]:
    offsets, at = [], 0
    for x in lines:
        offsets.append(at)
        at += len(x.get("text", ""))
    return {
        "tokens": [x["token_text"] for x in lines],
        "token_logprobs": [x["logprob"] for x in lines],
        "top_logprobs": [{t["text"]: t["logprob"] for t in x.get("top_logprobs", [])} for x in lines],
        "text_offset": offsets,
    }


# ------------------------------------------------------------------ whole answers


async def _collect(kind: str, upstream: EngineStream, rid: str, model: str, n: int, tools: bool) -> dict[str, Any]:
    texts: list[str] = [""] * n
    tokens: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    usage: dict[str, Any] = {}
    async for line in upstream.lines():
        if line["type"] == "token":
            texts[line["index"]] += line.get("text", "")
            if "logprob" in line:
                tokens[line["index"]].append(line)
        elif line["type"] == "finish":
            reasons[line["index"]] = line["finish_reason"]
        elif line["type"] == "done":
            usage = line["usage"]
    choices = [
        _chat_choice(i, texts[i], tokens[i], reasons[i], tools)
        if kind == "chat"
        else _text_choice(i, texts[i], tokens[i], reasons[i])
        for i in range(n)
    ]
    return chunk(kind, rid, model, choices, usage=usage) | {
        "object": "chat.completion" if kind == "chat" else "text_completion"
    }


def _chat_choice(i: int, text: str, tokens: list[dict[str, Any]], reason: str | None, tools: bool) -> dict[str, Any]:
    reasoning, content = ReasoningSplitter().push(text, final=True)
    message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
    if tools:
        message["content"], calls = split_tool_calls(content)
        if calls:
            message["tool_calls"] = calls
            reason = "tool_calls" if reason == "stop" else reason
    logprobs = {"content": [chat_logprobs(x) for x in tokens]} if tokens else None
    return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason}


def _text_choice(i: int, text: str, tokens: list[dict[str, Any]], reason: str | None) -> dict[str, Any]:
    return {"index": i, "text": text, "logprobs": _text_logprobs(tokens) if tokens else None, "finish_reason": reason}
