"""Pairwise preference data (issue 17): ``SharegptStylePairwiseHandler`` / ``AlpacaStylePairwiseHandler`` into
MindSpeed's pairwise indexed layout.

MindSpeed-LLM ``mindspeed_llm/tasks/preprocess/data_handler.py::AlpacaStylePairwiseHandler``: json_keys
``chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels`` under ``<output-prefix>_packed``, one sequence
per document (``_serialize_to_disk``: files ``<prefix>_packed_<key>_document.{bin,idx}``, a pair dropped whole when a
field reaches ``seq_length``); ids = prompt + answer, labels = -100 on the prompt; the prompt is the one
``template.encode_oneturn`` gives with the chosen answer (``templates.py::ReasoningTemplate.encode_oneturn``: earlier
answers lose their thoughts; the last answer follows enable_thinking). Read back with Megatron's own reader
(``decoder_packed_mtf_dataset.py`` reads these files when ``--is-pairwise-dataset``). Corpora:
``tests/corpus/pairwise_sharegpt.jsonl``, ``pairwise_alpaca.jsonl``; expected pieces written by hand.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.contract.indexed import instruction_prefix
from engine.contract.runfiles import RunDir
from engine.contract.spec import PreprocessSpec
from engine.data.tokenizer import load_tokenizer
from engine.preprocess import run

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import (
        IndexedDataset as MegatronIndexedDataset,
    )

CORPUS = Path(__file__).resolve().parents[3] / "corpus"
FIELDS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
EMPTY = "<think>\n\n</think>\n\n"


def user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _spec(tmp_path, tok_dir, name, handler, **over) -> PreprocessSpec:
    fields = {
        "input": str(CORPUS / name),
        "tokenizer_name_or_path": str(tok_dir),
        "output_prefix": str(tmp_path / "out" / "dpo"),
        "handler_name": handler,
        "prompt_type": "qwen3",
    }
    return PreprocessSpec(**{**fields, **over})


def _read(tmp_path) -> list[dict[str, list[int]]]:
    sets = {f: MegatronIndexedDataset(instruction_prefix(str(tmp_path / "out" / "dpo"), f)) for f in FIELDS}
    n = len(sets["chosen_input_ids"])
    assert all(len(ds) == n for ds in sets.values())
    return [{f: sets[f][i].tolist() for f in FIELDS} for i in range(n)]


def _expected(tok, prompt: str, chosen: str, rejected: str, chosen_prompt_tail: str = "") -> dict[str, list[int]]:
    """Prompt pieces are tokenized one by one as MindSpeed does; the prompt tail (the masked empty thought) too."""
    p = tok(prompt, add_special_tokens=False)["input_ids"] + (
        tok(chosen_prompt_tail, add_special_tokens=False)["input_ids"] if chosen_prompt_tail else []
    )
    c = tok(chosen, add_special_tokens=False)["input_ids"]
    r = tok(rejected, add_special_tokens=False)["input_ids"]
    return {
        "chosen_input_ids": p + c,
        "chosen_labels": [-100] * len(p) + c,
        "rejected_input_ids": p + r,
        "rejected_labels": [-100] * len(p) + r,
    }


def test_sharegpt_pairs_in_mindspeeds_layout(tmp_path, qwen_tokenizer_dir):
    tok = load_tokenizer(str(qwen_tokenizer_dir))
    outputs, summary = run(
        _spec(tmp_path, qwen_tokenizer_dir, "pairwise_sharegpt.jsonl", "SharegptStylePairwiseHandler"),
        RunDir(tmp_path / "run"),
    )
    assert sorted(outputs["files"].split(",")) == sorted(
        f"dpo_packed_{f}_document{s}" for f in FIELDS for s in (".bin", ".idx")
    )
    assert outputs["data_path"] == str((tmp_path / "out" / "dpo").resolve())
    rows = _read(tmp_path)
    # row 0, none: no thought in the chosen answer -> the empty thought ends the (masked) prompt
    assert rows[0] == _expected(
        tok,
        user("Which is larger, 9.11 or 9.9?"),
        "9.9 is larger.<|im_end|>\n",
        "9.11 is larger.<|im_end|>\n",
        chosen_prompt_tail=EMPTY,
    )
    # row 1: system + history; the chosen answer has a thought, so no empty thought; the prompt is the chosen one's
    expected = _expected(tok, "<|im_start|>system\nBe concise.<|im_end|>\n", "", "")
    history = [
        tok(t, add_special_tokens=False)["input_ids"]
        for t in (user("Capital of France?"), "Paris.<|im_end|>\n", user("And of Italy?"))
    ]
    prompt = expected["chosen_input_ids"] + [i for piece in history for i in piece]
    chosen = tok("<think>\nItaly's capital.\n</think>\n\nRome.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    rejected = tok("Milan.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert rows[1] == {
        "chosen_input_ids": prompt + chosen,
        "chosen_labels": [-100] * len(prompt) + chosen,
        "rejected_input_ids": prompt + rejected,
        "rejected_labels": [-100] * len(prompt) + rejected,
    }
    assert summary["samples_written"] == 2 and summary["trained_tokens"] == sum(
        sum(1 for x in r[f] if x != -100) for r in rows for f in ("chosen_labels", "rejected_labels")
    )


def test_alpaca_pairs_true_mode_and_seq_length_drop(tmp_path, qwen_tokenizer_dir):
    tok = load_tokenizer(str(qwen_tokenizer_dir))
    spec = _spec(
        tmp_path, qwen_tokenizer_dir, "pairwise_alpaca.jsonl", "AlpacaStylePairwiseHandler", enable_thinking="true"
    )
    run(spec, RunDir(tmp_path / "run"))
    rows = _read(tmp_path)
    haiku = "Soft rain on the roof\nwhispers to the sleeping town\npuddles hold the sky"
    first = _expected(
        tok, user("Write a haiku about rain."), EMPTY + haiku + "<|im_end|>\n", EMPTY + "Rain is wet.<|im_end|>\n"
    )
    # MindSpeed tokenizes the empty thought and the answer as separate pieces
    for side, text in (("chosen", haiku), ("rejected", "Rain is wet.")):
        answer = (
            tok(EMPTY, add_special_tokens=False)["input_ids"]
            + tok(text + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
        )
        prompt_len = len(tok(user("Write a haiku about rain."), add_special_tokens=False)["input_ids"])
        assert first[f"{side}_input_ids"][prompt_len:] == answer
    assert rows[0] == first
    assert rows[1] == _expected(
        tok, user("Translate to German.\nThank you"), EMPTY + "Danke<|im_end|>\n", EMPTY + "Merci<|im_end|>\n"
    )
    longest = len(rows[0]["chosen_input_ids"])
    _, summary = run(
        _spec(
            tmp_path,
            qwen_tokenizer_dir,
            "pairwise_alpaca.jsonl",
            "AlpacaStylePairwiseHandler",
            enable_thinking="true",
            seq_length=longest,
        ),
        RunDir(tmp_path / "run2"),
    )
    assert summary["samples_dropped"] == {"too_long": 1} and _read(tmp_path) == [rows[1]]


def test_pairwise_replaces_an_instruction_dataset_under_the_same_prefix(tmp_path, qwen_tokenizer_dir):
    prefix = tmp_path / "out" / "dpo"
    prefix.parent.mkdir(parents=True)
    for field in ("input_ids", "labels", "attention_mask"):
        for suffix in (".bin", ".idx"):
            Path(instruction_prefix(str(prefix), field) + suffix).write_bytes(b"old")
    run(
        _spec(tmp_path, qwen_tokenizer_dir, "pairwise_alpaca.jsonl", "AlpacaStylePairwiseHandler"),
        RunDir(tmp_path / "run"),
    )
    left = sorted(p.name for p in prefix.parent.iterdir())
    assert left == sorted(f"dpo_packed_{f}_document{s}" for f in FIELDS for s in (".bin", ".idx"))


def test_pairwise_spec_checks(tmp_path, qwen_tokenizer_dir):
    with pytest.raises(ValidationError, match="pack: not for pairwise data"):
        _spec(
            tmp_path,
            qwen_tokenizer_dir,
            "pairwise_alpaca.jsonl",
            "AlpacaStylePairwiseHandler",
            pack=True,
            seq_length=64,
        )
    spec = _spec(
        tmp_path,
        qwen_tokenizer_dir,
        "pairwise_sharegpt.jsonl",
        "SharegptStylePairwiseHandler",
        map_keys={"chosen": "chosen", "rejected": "rejected"},
    )
    assert spec.map_keys == {"chosen": "chosen", "rejected": "rejected"}


def test_openai_preference_jsonl_equals_its_sharegpt_form(tmp_path, qwen_tokenizer_dir):
    """OpenAI's preference fine-tuning records (input.messages, preferred_output, non_preferred_output) give the
    same pairs as the ShareGPT records they translate."""
    handler = "SharegptStylePairwiseHandler"
    run(_spec(tmp_path, qwen_tokenizer_dir, "pairwise_sharegpt.jsonl", handler), RunDir(tmp_path / "run"))
    sharegpt = _read(tmp_path)
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    lines = []
    for line in (CORPUS / "pairwise_sharegpt.jsonl").read_text().splitlines():
        record = json.loads(line)
        messages = [{"role": role[t["from"]], "content": t["value"]} for t in record["conversations"]]
        lines.append(
            {
                "input": {"messages": messages},
                "preferred_output": [{"role": "assistant", "content": record["chosen"]["value"]}],
                "non_preferred_output": [{"role": "assistant", "content": record["rejected"]["value"]}],
            }
        )
    source = tmp_path / "openai.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    spec = _spec(tmp_path / "o", qwen_tokenizer_dir, "pairwise_sharegpt.jsonl", handler, input=str(source))
    run(spec, RunDir(tmp_path / "run_openai"))
    assert _read(tmp_path / "o") == sharegpt
