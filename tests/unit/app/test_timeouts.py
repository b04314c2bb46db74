"""A request body that stalls is cut off with the JSON 408, also where a middleware (the input guard) reads it; a
complete body and a streaming answer's later reads are not timed."""

from __future__ import annotations

import json
from typing import Any

import anyio
from starlette.types import Message, Receive, Scope, Send

from app.input_guard import InputGuardMiddleware
from app.timeouts import BodyTimeoutMiddleware


async def _echo(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(parts: list[bytes], stall: bool) -> list[Message]:
    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/jobs", "query_string": b"", "headers": []}
    sent: list[Message] = []
    pending = list(parts)

    async def receive() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(0), "more_body": bool(pending) or stall}
        await anyio.sleep(60)  # the client went quiet
        raise AssertionError("not cut off")

    async def send(message: Message) -> None:
        sent.append(message)

    app = BodyTimeoutMiddleware(InputGuardMiddleware(_echo), seconds=0.2)
    anyio.run(app, scope, receive, send)
    return sent


def test_a_stalled_body_gets_the_json_408() -> None:
    sent = _call([b'{"kind": '], stall=True)
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["code"] == "request_timeout"


def test_a_complete_body_passes() -> None:
    sent = _call([b'{"kind": ', b'"train"}'], stall=False)
    assert (sent[0]["status"], sent[1]["body"]) == (200, b"ok")
