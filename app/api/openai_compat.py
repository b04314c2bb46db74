"""OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``.

The request path (``docs/serving.md``): authenticate the team token, find the caller's team's deployment named by
``model`` (``core.deployments``: another team's reads as missing, 404; one not ready yet is 503), translate the body
to the engine's internal protocol (``app.openai_format``), POST it to the engine's own endpoint on its worker host
(the URL its ``ready`` event gave) and stream the engine's JSON lines back as OpenAI objects, or SSE chunks ending
``data: [DONE]``. A client that disconnects closes the upstream stream, and the engine cancels its sequences. Every
error on these routes has OpenAI's shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import anyio
import httpx
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.deps import SettingsDep
from app.openai_format import (
    OpenAIError,
    ReasoningSplitter,
    chat_logprobs,
    chat_request,
    chunk,
    completion_request,
    new_id,
    split_tool_calls,
    sse,
)
from core.auth import Principal, authenticate
from core.db import get_sessionmaker
from core.deployments import Deployment, find_deployment, list_deployments
from core.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["openai"])
_bearer = HTTPBearer(auto_error=False, description="A team token: pass it as the openai client's api_key.")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
ENGINE_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=5.0)  # a long generation has no read limit


def _error(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


def _with_session(settings: Settings, work: Callable[[Any], Any]) -> Any:
    with get_sessionmaker(settings.database_url)() as session:
        return work(session)


def _principal(session: Any, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise OpenAIError(401, "missing bearer token (the openai client's api_key: a team token)", None, "unauthorized")
    principal = authenticate(session, credentials.credentials)
    if principal is None:
        raise OpenAIError(401, "invalid or revoked token", None, "invalid_api_key")
    return principal


async def _ready(settings: Settings, credentials: HTTPAuthorizationCredentials | None, model: str) -> Deployment:
    def lookup(session: Any) -> Deployment | None:
        return find_deployment(session, _principal(session, credentials), model)

    dep = await anyio.to_thread.run_sync(_with_session, settings, lookup)
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
    return dep


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as err:
        raise OpenAIError(400, f"body: not JSON: {err}", None, "invalid_json") from err
    if not isinstance(body, dict):
        raise OpenAIError(400, "body: must be a JSON object", None, "invalid_json")
    return body


async def _engine_lines(dep: Deployment, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """Open the engine's stream (errors raised before the first line is read); yields its JSON lines."""
    client = httpx.AsyncClient(timeout=ENGINE_TIMEOUT)
    try:
        response = await client.send(client.build_request("POST", f"{dep.url}/v1/generate", json=payload), stream=True)
    except httpx.HTTPError as err:
        await client.aclose()
        log.warning("deployment %s at %s: %s", dep.name, dep.url, err)
        raise OpenAIError(
            503, f"deployment {dep.name!r} is not answering", "model", "model_not_ready", **{"Retry-After": "5"}
        ) from err
    if response.status_code != 200:
        raw = await response.aread()
        await response.aclose()
        await client.aclose()
        raise _engine_error(response, raw)

    async def lines() -> AsyncIterator[dict[str, Any]]:
        try:
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)
        finally:
            await response.aclose()
            await client.aclose()

    return lines()


def _engine_error(response: httpx.Response, raw: bytes) -> OpenAIError:
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": f"engine answered {response.status_code}", "field": None}
    if response.status_code == 429:
        retry = response.headers.get("Retry-After", "1")
        return OpenAIError(429, error["message"], None, "queue_full", **{"Retry-After": retry})
    if response.status_code == 404:  # an adapter the engine does not hold (its spec changed under it)
        return OpenAIError(404, error["message"], "model", "model_not_found")
    status = 400 if response.status_code == 400 else 502
    return OpenAIError(status, error["message"], error.get("field"), error.get("type"))


# ------------------------------------------------------------------ routes


@router.get("/models")
async def models(settings: SettingsDep, credentials: Credentials) -> JSONResponse:
    """The caller's team's ready deployments and their LoRA adapters, as OpenAI's model list."""

    def listing(session: Any) -> list[Deployment]:
        return list_deployments(session, _principal(session, credentials))

    try:
        deps = await anyio.to_thread.run_sync(_with_session, settings, listing)
    except OpenAIError as err:
        return _error(err)
    return JSONResponse({"object": "list", "data": [m for d in deps if d.ready for m in _model_objects(d)]})


def _model_objects(dep: Deployment) -> list[dict[str, Any]]:
    """OpenAI model objects of a deployment: its base, then each LoRA adapter with the base as ``parent`` (vLLM's
    ``root`` / ``parent`` convention: the path each was loaded from, the model an adapter applies to)."""
    common = {"object": "model", "created": dep.created, "owned_by": dep.team, "job_id": dep.job_id}
    base = {"id": dep.name, **common, "root": dep.root, "parent": None}
    return [base, *({"id": n, **common, "root": path, "parent": dep.name} for n, path in dep.adapters.items())]


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    request: Request, settings: SettingsDep, credentials: Credentials
) -> JSONResponse | StreamingResponse:
    """OpenAI's chat completions on a deployment (``model``): Qwen3 chat template, thinking as reasoning_content."""
    return await _complete(request, settings, credentials, "chat")


@router.post("/completions", response_model=None)
async def completions(
    request: Request, settings: SettingsDep, credentials: Credentials
) -> JSONResponse | StreamingResponse:
    """OpenAI's (legacy) text completions on a deployment (``model``): the prompt is tokenized as it is."""
    return await _complete(request, settings, credentials, "text")


async def _complete(
    request: Request, settings: Settings, credentials: HTTPAuthorizationCredentials | None, kind: str
) -> JSONResponse | StreamingResponse:
    try:
        body = await _body(request)
        payload = chat_request(body) if kind == "chat" else completion_request(body)
        dep = await _ready(settings, credentials, body["model"])
        if dep.adapter is not None:
            payload["model"] = dep.adapter  # the engine applies this adapter to the request's sequences
        lines = await _engine_lines(dep, payload)
    except OpenAIError as err:
        return _error(err)
    rid, model = new_id("chatcmpl" if kind == "chat" else "cmpl"), dep.adapter or dep.name
    if body.get("stream"):
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            _stream(kind, lines, rid, model, payload.get("n", 1), usage), media_type="text/event-stream"
        )
    return JSONResponse(await _collect(kind, lines, rid, model, payload.get("n", 1), bool(body.get("tools"))))


# ------------------------------------------------------------------ streaming


async def _stream(
    kind: str, lines: AsyncIterator[dict[str, Any]], rid: str, model: str, n: int, include_usage: bool
) -> AsyncIterator[bytes]:
    splitters = [ReasoningSplitter() for _ in range(n)]
    started: set[int] = set()
    async for line in lines:
        if line["type"] in ("token", "finish"):
            i, final = line["index"], line["type"] == "finish"
            choice = _chat_delta(line, splitters[i], i not in started) if kind == "chat" else _text_delta(line)
            started.add(i)
            if choice is not None or final:
                choice = choice or {"index": i, "logprobs": None}
                if kind == "chat":
                    choice.setdefault("delta", {})
                else:
                    choice.setdefault("text", "")
                choice["finish_reason"] = line["finish_reason"] if final else None
                yield sse(chunk(kind, rid, model, [choice]))
        elif line["type"] == "done" and include_usage:
            yield sse(chunk(kind, rid, model, [], usage=line["usage"]))
    yield sse("[DONE]")


def _chat_delta(line: dict[str, Any], splitter: ReasoningSplitter, first: bool) -> dict[str, Any] | None:
    reasoning, content = splitter.push(line.get("text", ""), final=line["type"] == "finish")
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    lp = chat_logprobs(line) if line["type"] == "token" else None
    if not delta and lp is None:
        return None
    return {"index": line["index"], "delta": delta, "logprobs": {"content": [lp]} if lp else None}


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


async def _collect(
    kind: str, lines: AsyncIterator[dict[str, Any]], rid: str, model: str, n: int, tools: bool
) -> dict[str, Any]:
    texts: list[str] = [""] * n
    tokens: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    usage: dict[str, Any] = {}
    async for line in lines:
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
            message["tool_calls"], reason = calls, "tool_calls"
    logprobs = {"content": [chat_logprobs(x) for x in tokens]} if tokens else None
    return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason}


def _text_choice(i: int, text: str, tokens: list[dict[str, Any]], reason: str | None) -> dict[str, Any]:
    return {"index": i, "text": text, "logprobs": _text_logprobs(tokens) if tokens else None, "finish_reason": reason}
