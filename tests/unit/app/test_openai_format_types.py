"""Every field the OpenAI routes accept has its JSON type checked before anything reaches an engine: a wrong type is a
400 naming the field (issue 39: ``stream_options: "x"`` answered 500 and left the engine generating; a ``stop`` list
of non-strings answered 200 with empty content)."""

from __future__ import annotations

from typing import Any

import pytest

from app.openai_format import CHAT_FIELDS, COMPLETION_FIELDS, OpenAIError, chat_request, completion_request

# One wrongly typed value per field: a field added to the routes without a type check fails here until it has one.
WRONG: dict[str, Any] = {
    "model": 7,
    "messages": "hi",
    "prompt": {"text": "hi"},
    "stream": "yes",
    "stream_options": "x",
    "max_tokens": 2.5,
    "max_completion_tokens": "16",
    "logprobs": "yes",
    "top_logprobs": 1.5,
    "chat_template_kwargs": ["enable_thinking"],
    "tools": {"name": "play"},
    "tool_choice": 3,
    "user": 42,
    "temperature": "hot",
    "top_p": [1],
    "top_k": True,
    "seed": "3",
    "n": 1.0,
    "stop": [1, 2],
    "presence_penalty": float("nan"),
    "frequency_penalty": float("inf"),
    "repetition_penalty": "1e-300",
    "response_format": "json_object",
    "structured_outputs": ["yes", "no"],
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}


def test_every_accepted_field_has_a_wrong_type_example() -> None:
    assert set(WRONG) == CHAT_FIELDS | COMPLETION_FIELDS


@pytest.mark.parametrize(
    ("fields", "base", "translate"), [(CHAT_FIELDS, CHAT, chat_request), (COMPLETION_FIELDS, TEXT, completion_request)]
)
def test_a_wrong_type_is_a_400_naming_its_field(fields: set[str], base: dict[str, Any], translate: Any) -> None:
    translate(dict(base))  # the base body itself is fine
    for name in sorted(fields):
        with pytest.raises(OpenAIError) as err:
            translate({**base, name: WRONG[name]})
        assert (err.value.status, err.value.param) == (400, name), err.value.message
        assert err.value.message.startswith(f"{name}: must be") or name == "model", err.value.message


def test_right_types_and_nulls_pass() -> None:
    body = {
        **CHAT,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["a", "b"],
        "temperature": 0,
        "top_p": 0.5,
        "seed": None,
        "max_completion_tokens": None,
        "max_tokens": 4,
        "tool_choice": "auto",
        "logprobs": True,
        "top_logprobs": 2,
    }
    assert chat_request(body).to_json() == {
        "stop": ["a", "b"],
        "temperature": 0,
        "top_p": 0.5,
        "messages": CHAT["messages"],
        "max_tokens": 4,
        "logprobs": 2,
    }
    assert completion_request({**TEXT, "logprobs": 0, "stop": "x", "max_tokens": None}).options.max_tokens == 16
    with pytest.raises(OpenAIError) as err:
        chat_request({**CHAT, "stream_options": {"include_usage": "yes"}})
    assert err.value.param == "stream_options"
