"""Templates against transformers' apply_chat_template with the real Qwen3 chat template.

Where MindSpeed and the HF template agree, ids must be equal; where MindSpeed defines something else (the empty
thought on every turn for none/false, reasoning kept on earlier turns for true/none), the difference is asserted.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.contract.constants import IGNORE_INDEX
from engine.data.templates import (
    EMPTY_THOUGHT,
    ConversationError,
    encode_conversation,
    encode_conversations,
    encode_prompt,
)
from engine.data.tokenizer import load_tokenizer

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {
    "role": "user",
    "content": "请你判读用户的意图。交互历史：用户：广州塔为什么也叫小蛮腰\n用户最后一句话所属的技能和意图是：",
}
ANSWER = {"role": "assistant", "content": "闲聊百科_知识查询"}
REASONED = {"role": "assistant", "content": "<think>\nThe user asks about a landmark.\n</think>\n\n闲聊百科_知识查询"}


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir):
    return load_tokenizer(str(qwen_tokenizer_dir))


def hf_ids(tok, messages, **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])


def hf_text(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def trained_text(tok, ids: np.ndarray, labels: np.ndarray) -> str:
    assert ids.shape == labels.shape and ids.dtype == labels.dtype == np.int32
    kept = labels != IGNORE_INDEX
    assert (labels[kept] == ids[kept]).all(), "labels must be the input ids where trained"
    return tok.decode(ids[kept].tolist())


@pytest.mark.parametrize("mode", ["true", "false", "none", True, False, None])
def test_single_turn_ids_match_hf_in_every_mode(tok, mode):
    ids, labels = encode_conversation(tok, [SYSTEM, USER, ANSWER], "qwen3", mode)
    assert ids.tolist() == hf_ids(tok, [SYSTEM, USER, ANSWER])
    trained = trained_text(tok, ids, labels)
    if str(mode).lower() == "true":  # empty thought prepended to the response, inside the loss
        assert trained == EMPTY_THOUGHT + "闲聊百科_知识查询<|im_end|>\n"
    else:  # empty thought appended to the prompt, masked
        assert trained == "闲聊百科_知识查询<|im_end|>\n"


def test_masked_prefix_is_everything_before_the_response(tok):
    ids, labels = encode_conversation(tok, [SYSTEM, USER, ANSWER], "qwen3", "none")
    first = int(np.flatnonzero(labels != IGNORE_INDEX)[0])
    assert tok.decode(ids[:first].tolist()).endswith("<|im_start|>assistant\n" + EMPTY_THOUGHT)
    assert (labels[:first] == IGNORE_INDEX).all() and (labels[first:] != IGNORE_INDEX).all()


@pytest.mark.parametrize("mode", ["true", "none"])
def test_existing_reasoning_is_kept_and_trained(tok, mode):
    ids, labels = encode_conversation(tok, [USER, REASONED], "qwen3", mode)
    assert ids.tolist() == hf_ids(tok, [USER, REASONED])
    assert trained_text(tok, ids, labels) == REASONED["content"] + "<|im_end|>\n"


def test_false_strips_reasoning_and_masks_the_empty_thought(tok):
    ids, labels = encode_conversation(tok, [USER, REASONED], "qwen3", "false")
    assert ids.tolist() == hf_ids(tok, [USER, ANSWER])
    assert trained_text(tok, ids, labels) == "闲聊百科_知识查询<|im_end|>\n"


def test_multi_turn_trains_every_assistant_turn(tok):
    conv = [SYSTEM, USER, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "again"}, ANSWER]
    ids, labels = encode_conversation(tok, conv, "qwen3", "true")
    assert (
        trained_text(tok, ids, labels)
        == EMPTY_THOUGHT + "A1<|im_end|>\n" + EMPTY_THOUGHT + "闲聊百科_知识查询<|im_end|>\n"
    )
    kept = np.flatnonzero(labels != IGNORE_INDEX)
    assert np.diff(kept).max() > 1, "the second user turn between the two answers is masked"


@pytest.mark.parametrize("mode", ["false", "none"])
def test_multi_turn_empty_thought_on_every_turn_differs_from_hf(tok, mode):
    """MindSpeed puts the empty thought before every assistant turn; HF only after the last user query."""
    conv = [USER, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "again"}, ANSWER]
    ids, _ = encode_conversation(tok, conv, "qwen3", mode)
    reference = hf_text(tok, conv)
    assert reference.count(EMPTY_THOUGHT) == 1
    expected = reference.replace("<|im_start|>assistant\nA1", "<|im_start|>assistant\n" + EMPTY_THOUGHT + "A1")
    assert ids.tolist() == tok(expected, add_special_tokens=False)["input_ids"]


def test_true_keeps_reasoning_of_earlier_turns_unlike_hf(tok):
    conv = [USER, REASONED, {"role": "user", "content": "again"}, ANSWER]
    ids, labels = encode_conversation(tok, conv, "qwen3", "true")
    reference = hf_text(tok, conv)
    assert "The user asks" not in reference  # HF strips reasoning before the last query
    expected = reference.replace(
        "<|im_start|>assistant\n闲聊百科_知识查询<|im_end|>\n<|im_start|>user\nagain",
        "<|im_start|>assistant\n" + REASONED["content"] + "<|im_end|>\n<|im_start|>user\nagain",
    )
    assert ids.tolist() == tok(expected, add_special_tokens=False)["input_ids"]
    assert "The user asks" in trained_text(tok, ids, labels)


def test_qwen_template_has_no_thinking_rules(tok):
    ids, labels = encode_conversation(tok, [SYSTEM, USER, ANSWER], "qwen", "false")
    text = tok.decode(ids.tolist())
    assert "<think>" not in text
    # MindSpeed's qwen: the answer ends with <|im_end|> and no newline (tests/unit/engine/data/test_data_qwen_template.py)
    assert text == hf_text(tok, [SYSTEM, USER, ANSWER]).replace(EMPTY_THOUGHT, "").removesuffix("\n")
    assert trained_text(tok, ids, labels) == "闲聊百科_知识查询<|im_end|>"


@pytest.mark.parametrize("mode", ["true", "false", "none"])
def test_hf_template_ids_equal_apply_chat_template(tok, mode):
    conv = [SYSTEM, USER, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "again"}, ANSWER]
    ids, labels = encode_conversation(tok, conv, "hf", mode)
    kwargs = {} if mode == "none" else {"enable_thinking": mode == "true"}
    assert ids.tolist() == hf_ids(tok, conv, **kwargs)
    last = "闲聊百科_知识查询<|im_end|>\n" if mode == "false" else EMPTY_THOUGHT + "闲聊百科_知识查询<|im_end|>\n"
    assert trained_text(tok, ids, labels) == "A1<|im_end|>\n" + last


@pytest.mark.parametrize("template", ["qwen3", "hf"])
@pytest.mark.parametrize("mode", ["true", "false", "none"])
def test_prompt_matches_hf_generation_prompt(tok, template, mode):
    """true: the model writes its thought; false/none: the empty thought is in the prompt, as in training."""
    ids = encode_prompt(tok, [SYSTEM, USER, ANSWER], template, mode)  # the reference answer is dropped
    thinking = mode == "true"
    expected = hf_ids(tok, [SYSTEM, USER], add_generation_prompt=True, enable_thinking=thinking)
    if template == "hf" and mode == "none":
        expected = hf_ids(tok, [SYSTEM, USER], add_generation_prompt=True)
    assert ids == expected


def test_prompt_of_training_sample_is_its_masked_prefix(tok):
    ids, labels = encode_conversation(tok, [SYSTEM, USER, ANSWER], "qwen3", "none")
    prompt = encode_prompt(tok, [SYSTEM, USER], "qwen3", "none")
    assert ids[: len(prompt)].tolist() == prompt and (labels[: len(prompt)] == IGNORE_INDEX).all()


def test_tool_turns_render_like_qwen3(tok):
    call = {
        "role": "function_call",
        "content": json.dumps({"name": "weather", "arguments": {"city": "广州"}}, ensure_ascii=False),
    }
    conv = [USER, call, {"role": "tool", "content": "sunny"}, ANSWER]
    ids, labels = encode_conversation(tok, conv, "qwen3", "true")
    text = tok.decode(ids.tolist())
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "广州"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert "sunny" not in trained_text(tok, ids, labels) and "weather" in trained_text(tok, ids, labels)


@pytest.mark.parametrize(
    "conv, problem",
    [
        ([], "empty conversation"),
        ([USER], "must end with an assistant turn"),
        ([SYSTEM], "only a system message"),
        ([ANSWER, USER], "role 'assistant' where user or observation was expected"),
        ([USER, {"role": "robot", "content": "x"}], "unknown role 'robot'"),
        ([USER, {"role": "assistant", "content": None}], "content must be a string"),
    ],
)
def test_bad_conversations_name_the_problem(tok, conv, problem):
    with pytest.raises(ConversationError, match=problem):
        encode_conversation(tok, conv, "qwen3", "none")


def test_batch_equals_one_by_one(tok):
    convs = [
        [SYSTEM, USER, ANSWER],
        [USER, REASONED],
        [SYSTEM, {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
    ]
    batch = encode_conversations(tok, convs, "qwen3", "none")
    for conv, (ids, labels) in zip(convs, batch):
        one = encode_conversation(tok, conv, "qwen3", "none")
        assert ids.tolist() == one[0].tolist() and labels.tolist() == one[1].tolist()


def test_unknown_template_is_refused(tok):
    with pytest.raises(ValueError, match="prompt_type: unknown template 'llama3'"):
        encode_conversation(tok, [USER, ANSWER], "llama3")


@pytest.mark.parametrize("template", ["qwen3", "hf"])
def test_function_call_that_is_not_json_is_a_conversation_error(tok, template):
    conv = [USER, {"role": "function_call", "content": "call weather please"}]
    with pytest.raises(ConversationError, match="function call content is not JSON"):
        encode_conversation(tok, conv, template)


def test_hf_tool_call_ids_equal_apply_chat_template(tok):
    call = {"name": "weather", "arguments": {"city": "广州"}}
    conv = [
        USER,
        {"role": "function_call", "content": json.dumps(call, ensure_ascii=False)},
        {"role": "tool", "content": "sunny"},
        ANSWER,
    ]
    ids, labels = encode_conversation(tok, conv, "hf", "none")
    hf_conv = [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "sunny"},
        ANSWER,
    ]
    assert ids.tolist() == hf_ids(tok, hf_conv)
    assert "weather" in trained_text(tok, ids, labels) and "sunny" not in trained_text(tok, ids, labels)


def test_tool_definitions_without_a_named_function_are_refused_by_name() -> None:
    from engine.data.templates import parse_tools

    assert parse_tools('{"name": "f"}') == [{"type": "function", "function": {"name": "f"}}]
    for bad in ([{"function": "x"}], [{"function": {"description": "no name"}}], ["f"]):
        with pytest.raises(ConversationError, match="tools: entry 0 must be an object with a name"):
            parse_tools(bad)
