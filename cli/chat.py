"""``llmjobs chat DEPLOYMENT``: a terminal conversation with a deployment over the OpenAI-compatible routes.

One message per stdin line; each answer streams to the terminal as its chunks arrive (the thought, when the model
thinks, dimmed before it). The conversation is kept and sent whole each turn, as a chat client does: the answers'
content, not their thoughts (Qwen3's template drops past thoughts anyway). ``/exit`` or the end of input ends it.
The connection and the team token are the other client commands' (``LLMJOBS_URL``, ``LLMJOBS_TOKEN``).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import httpx
import typer
from httpx_sse import connect_sse

from cli import remote


class ChatError(Exception):
    """An answer in OpenAI's error shape (or none): its message, shown as the command's error."""


def _error_text(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return f"HTTP {response.status_code} {error.get('code')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text}"


def stream_answer(http: httpx.Client, body: dict[str, Any]) -> str:
    """Stream one answer of ``/v1/chat/completions`` to stdout; returns its content."""
    content, thinking = [], False
    try:
        with connect_sse(http, "POST", "/v1/chat/completions", json=body, timeout=None) as source:
            if source.response.status_code >= 400:
                source.response.read()
                raise ChatError(_error_text(source.response))
            for sse in source.iter_sse():
                if sse.data == "[DONE]":
                    break
                for choice in json.loads(sse.data).get("choices", []):
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning_content"):
                        thinking = True
                        typer.echo(typer.style(delta["reasoning_content"], dim=True), nl=False)
                    if delta.get("content"):
                        if thinking:
                            thinking = False
                            typer.echo()
                        content.append(delta["content"])
                        typer.echo(delta["content"], nl=False)
    except httpx.HTTPError as err:
        raise ChatError(f"cannot reach {http.base_url}: {err}") from err
    typer.echo()
    return "".join(content)


def chat(
    deployment: Annotated[str, typer.Argument(help="a deployment's model name (GET /v1/models), or an adapter's")],
    system: Annotated[str | None, typer.Option(help="a system prompt opening the conversation")] = None,
    no_thinking: Annotated[bool, typer.Option("--no-thinking", help="Qwen3's enable_thinking false")] = False,
    temperature: Annotated[float | None, typer.Option(help="0: greedy; unset: the deployment's default")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="the most tokens of one answer")] = None,
) -> None:
    """Chat with a deployment: one message per line, answers streamed; /exit or end of input ends."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    options: dict[str, Any] = {"model": deployment, "stream": True}
    if no_thinking:
        options["chat_template_kwargs"] = {"enable_thinking": False}
    if temperature is not None:
        options["temperature"] = temperature
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    http = remote.Client().http
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            typer.echo("> ", nl=False, err=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        try:
            answer = stream_answer(http, {**options, "messages": history})
        except ChatError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1) from err
        history.append({"role": "assistant", "content": answer})
