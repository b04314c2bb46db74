"""Reading a test set: prompts rendered like training data (enable_thinking honoured), references split off, bad
lines reported with their line number and reason, or fatal under the error policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.contract.runfiles import BadInput
from engine.eval.dataset import read_test_set

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in records))
    return path


def _conv(user: str, answer: str | None = "天气_查询") -> dict:
    msgs = [SYSTEM, {"role": "user", "content": user}]
    return {"messages": msgs + ([{"role": "assistant", "content": answer}] if answer is not None else [])}


@pytest.mark.parametrize(
    "thinking,suffix",
    [
        ("none", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("false", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("true", "<|im_start|>assistant\n"),
    ],
)
def test_prompt_is_the_training_template_up_to_the_answer(tok, tmp_path: Path, thinking: str, suffix: str) -> None:
    data = _write(tmp_path / "t.jsonl", [_conv("明天北京天气怎么样")])
    line = read_test_set(data, tok, enable_thinking=thinking).lines[0]
    text = tok.decode(line.prompt_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n明天北京天气")
    assert text.endswith(suffix)
    assert (line.number, line.input, line.reference) == (1, "明天北京天气怎么样", "天气_查询")


def test_sharegpt_layout_through_map_keys(tok, tmp_path: Path) -> None:
    rec = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "闲聊"}]}
    data = _write(tmp_path / "t.jsonl", [rec])
    keys = {
        "messages": "conversations",
        "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"},
    }
    assert read_test_set(data, tok, map_keys=keys).lines[0].reference == "闲聊"


def test_bad_lines_are_skipped_with_reasons_and_count_towards_the_size_limit(tok, tmp_path: Path) -> None:
    data = _write(
        tmp_path / "t.jsonl",
        [
            _conv("ok"),
            _conv("no answer", None),
            "{broken",
            _conv("empty answer", "  "),
            _conv("很长" * 400),
            _conv("ok again"),
            _conv("beyond the limit"),
        ],
    )
    ts = read_test_set(data, tok, limit=6, max_prompt_tokens=200)
    assert [line.number for line in ts.lines] == [1, 6]
    reasons = {b.number: b.reason for b in ts.bad}
    assert set(reasons) == {2, 3, 4, 5}
    assert "no assistant answer" in reasons[2] and "malformed JSON" in reasons[3]
    assert "empty" in reasons[4] and "more than the 200 allowed" in reasons[5]


def test_error_policy_fails_on_the_first_bad_line(tok, tmp_path: Path) -> None:
    data = _write(tmp_path / "t.jsonl", [_conv("ok"), _conv("no answer", None)])
    with pytest.raises(BadInput, match=r"t.jsonl:2: no assistant answer") as err:
        read_test_set(data, tok, policy="error")
    assert err.value.field == "eval_data_path"
    with pytest.raises(BadInput, match="eval_data_path: .*does not exist"):
        read_test_set(tmp_path / "missing.jsonl", tok)
