"""The engine's incremental ``Detokenizer`` (``engine.serve.protocol``) sends, token by token, exactly the deltas that
decoding the whole output at every token sends: with the real Qwen3 tokenizer, over outputs whose characters span
several tokens (CJK, emoji, random byte-level ids), special tokens skipped, and stop strings cut where they appear."""

from __future__ import annotations

import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from cli.demo import tokenizer_source
from engine.serve.protocol import Detokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_source())


def _full_decode_deltas(tokenizer: Any, ids: list[int], stop: tuple[str, ...]) -> list[str]:
    """The deltas of a detokenizer that decodes all of the output at each token (the rule the incremental one keeps)."""
    hold, sent, out = max((len(s) for s in stop), default=1) - 1, 0, []
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        cut = min((at for s in stop if (at := text.find(s, max(0, sent - len(s)))) != -1), default=None)
        upto = cut if cut is not None else (sent if text.endswith("\ufffd") else len(text) - hold)
        out.append(text[sent:upto] if upto > sent else "")
        sent = max(sent, upto)
        if cut is not None:
            return out
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return [*out, text[sent:]]


def _incremental_deltas(tokenizer: Any, ids: list[int], stop: tuple[str, ...]) -> list[str]:
    detok, out = Detokenizer(tokenizer, stop), []
    for token in ids:
        out.append(detok.push(token))
        if detok.stopped:
            return out
    return [*out, detok.flush()]


def _outputs(tokenizer: Any) -> list[list[int]]:
    rng = random.Random(7)
    text = "Hello 世界! Ünïcödé 🎉🚀 and ﷽ — done.\n你好，我是通义千问。"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    randoms = [[rng.randrange(0, 151643) for _ in range(300)] for _ in range(3)]
    return [ids, ids[:5] + [end] + ids[5:], *randoms]


@pytest.mark.parametrize("stop", [(), ("千问",), ("!", "\n")])
def test_incremental_deltas_equal_full_decodes(tokenizer, stop) -> None:
    outputs = _outputs(tokenizer)
    assert any(
        len(tokenizer.decode([t])) and tokenizer.decode([t]).endswith("\ufffd") for t in outputs[0]
    )  # split chars
    for ids in outputs:
        assert _incremental_deltas(tokenizer, ids, stop) == _full_decode_deltas(tokenizer, ids, stop)
