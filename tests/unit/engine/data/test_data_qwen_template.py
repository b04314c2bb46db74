"""``--prompt-type qwen`` equal to MindSpeed's ``qwen`` (issue 17 item 3), and eval using the template it is given.

Expected pieces are written by hand from MindSpeed-LLM's ``configs/finetune/templates.json`` entry ``qwen`` and the
``Template`` class / formatters it falls back to (``mindspeed_llm/tasks/preprocess/templates.py``
``_register_template``: ``default_assistant_formatter`` = content + eos, ``replace_eos`` makes eos ``<|im_end|>``;
``Template._encode``: separator before every even message after the first; ``formatter.py``
``FunctionFormatter`` and ``default_tool_formatter``). MindSpeed tokenizes each piece on its own, so the expected
ids are the pieces' ids concatenated. Corpora: ``tests/corpus/alpaca_rows.jsonl``, ``tools_sharegpt.jsonl``,
``long_samples.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.contract.indexed import InstructionDataset
from engine.contract.runfiles import RunDir
from engine.contract.spec import EvalSpec, PreprocessSpec
from engine.data.formats import iter_conversations
from engine.data.templates import (
    IGNORE_INDEX,
    ConversationError,
    encode_conversation,
    encode_prompt,
)
from engine.data.tokenizer import load_tokenizer
from engine.eval.dataset import read_test_set
from engine.preprocess import run

CORPUS = Path(__file__).resolve().parents[3] / "corpus"
SYS = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
TOOL_TEXT = (
    "You have access to the following tools:\n> Tool Name: get_weather\nTool Description: Current weather for a city\n"
    "Tool Args:\n  - city (string, required): City name, e.g. 广州\n  - unit (string): , should be one of [celsius, "
    "fahrenheit]\n\nUse the following format if using a tool:\n```\nAction: tool name (one of [get_weather]).\n"
    'Action Input: the input to the tool, in a JSON format representing the kwargs (e.g. ```{"input": "hello '
    'world", "num_beams": 5}```).\n```\n'
)


def user(text: str, role: str = "user") -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n<|im_start|>assistant\n"


EXPECTED = {
    "alpaca_0": [
        (SYS, False),
        (user("Translate to French.\nGood morning"), False),
        ("Bonjour", True),
        ("<|im_end|>", True),
    ],
    "alpaca_1": [
        ("<|im_start|>system\nAnswer briefly.<|im_end|>\n", False),
        (user("Hi"), False),
        ("Hello!", True),
        ("<|im_end|>", True),
        ("\n", False),
        (user("Name a prime."), False),
        ("7", True),
        ("<|im_end|>", True),
    ],
    "tools_0": [
        (f"<|im_start|>system\nYou are a helpful assistant.{TOOL_TEXT}<|im_end|>\n", False),
        (user("What's the weather in Guangzhou?"), False),
        ('Action: get_weather\nAction Input: {"city": "广州", "unit": "celsius"}', True),
        ("<|im_end|>", True),
        ("\n", False),
        (user('{"temperature": 28, "sky": "cloudy"}', role="tool"), False),
        ("It is 28 °C and cloudy in Guangzhou.", True),
        ("<|im_end|>", True),
    ],
}


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir):
    return load_tokenizer(str(qwen_tokenizer_dir))


def expected_ids(tok, pieces) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    return ids, labels


def conversations(name: str, map_keys, handler: str) -> list[list[dict]]:
    return [m for _, _, m in iter_conversations(CORPUS / name, map_keys, handler)]


@pytest.mark.parametrize("mode", ["true", "none"])
def test_alpaca_rows_equal_mindspeed_qwen(tok, mode):
    rows = conversations(
        "alpaca_rows.jsonl", {"system": "system", "history": "history"}, "AlpacaStyleInstructionHandler"
    )
    for i, messages in enumerate(rows):
        ids, labels = encode_conversation(tok, messages, "qwen", mode)  # no thinking rules: mode changes nothing
        assert (ids.tolist(), labels.tolist()) == expected_ids(tok, EXPECTED[f"alpaca_{i}"])


def test_sharegpt_tool_row_equals_mindspeed_qwen(tok):
    messages = conversations("tools_sharegpt.jsonl", {"tools": "tools"}, "SharegptStyleInstructionHandler")[0]
    ids, labels = encode_conversation(tok, messages, "qwen")
    assert (ids.tolist(), labels.tolist()) == expected_ids(tok, EXPECTED["tools_0"])


def test_parallel_calls_are_refused_under_qwen(tok):
    messages = conversations("tools_sharegpt.jsonl", {"tools": "tools"}, "SharegptStyleInstructionHandler")[1]
    with pytest.raises(ConversationError, match="template qwen: one function call per turn"):
        encode_conversation(tok, messages, "qwen")


def test_over_long_samples_under_qwen_are_cut_to_seq_length_then_dropped(tmp_path, qwen_tokenizer_dir):
    """MindSpeed's qwen uses the older infer_max_len with budget seq_length: a cut sample reaches seq_length and the
    writer drops it (pairs: sample 1 (107, 64) -> (41, 23) = 64; sample 2 (23, 3) + (64, 47) -> 26 + 38 = 64)."""
    spec = PreprocessSpec(
        input=str(CORPUS / "long_samples.jsonl"),
        tokenizer_name_or_path=str(qwen_tokenizer_dir),
        output_prefix=str(tmp_path / "out" / "q"),
        handler_name="SharegptStyleInstructionHandler",
        prompt_type="qwen",
        seq_length=64,
    )
    _, summary = run(spec, RunDir(tmp_path / "run"))
    ds = InstructionDataset(tmp_path / "out" / "q")
    assert len(ds) == 1 and ds[0].input_ids.size == 23 and summary["samples_dropped"] == {"too_long": 2}


def test_generation_prompt_and_eval_use_the_qwen_template(tok, tmp_path):
    prompt = encode_prompt(tok, [{"role": "user", "content": "Hi"}], "qwen", "false")
    assert prompt == tok(SYS + user("Hi"), add_special_tokens=False)["input_ids"]
    path = tmp_path / "test.jsonl"
    path.write_text(
        json.dumps({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}) + "\n",
        encoding="utf-8",
    )
    for template in ("qwen", "qwen3"):
        line = read_test_set(path, tok, template=template).lines[0]
        assert line.prompt_ids == encode_prompt(tok, [{"role": "user", "content": "Hi"}], template, "none")
    assert read_test_set(path, tok, template="qwen").lines[0].prompt_ids != read_test_set(path, tok).lines[0].prompt_ids


def test_eval_spec_refuses_an_unknown_template(tmp_path):
    with pytest.raises(ValueError, match="prompt_type"):
        EvalSpec(load=str(tmp_path), eval_data_path=str(tmp_path), prompt_type="chatml")
    assert EvalSpec(load=str(tmp_path), eval_data_path=str(tmp_path), prompt_type="qwen").prompt_type == "qwen"
