"""One streamed chat request through the ``openai`` client, timed as the serving benchmarks time it (a helper of
``bench/``, not a benchmark): greedy, thinking off, usage asked for in the last chunk."""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import openai


def stream_chat(client: openai.OpenAI, model: str, msgs: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """The streamed text, its completion tokens (the server's usage, else the content chunks), the time to the first
    content chunk and the gaps between consecutive ones (s)."""
    start = time.perf_counter()
    stamps: list[float] = []
    text, tokens = "", None
    stream = client.chat.completions.create(
        model=model,
        messages=msgs,  # type: ignore[arg-type]
        stream=True,
        temperature=0,
        max_tokens=max_tokens,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            text += chunk.choices[0].delta.content
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    ttft = (stamps[0] if stamps else time.perf_counter()) - start
    return {"text": text, "tokens": tokens if tokens is not None else len(stamps), "ttft": ttft, "gaps": gaps}


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
