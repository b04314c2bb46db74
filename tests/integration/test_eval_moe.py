"""The eval job on a tiny random Qwen3-MoE (a dense layer mixed in): from its HF directory and from its MindSpeed
mcore conversion (EP 2, grouped experts), greedy generation equals ``transformers`` ``generate`` and loss mode equals
``transformers``' loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

from engine.cli import main
from engine.contract.runfiles import EXIT_OK
from engine.data.templates import encode_conversation, encode_prompt

QUESTIONS = [
    "广州塔为什么也叫小蛮腰",
    "play jazz",
    "明天北京天气怎么样？请告诉我",
    "turn off the lights",
    "hi",
    "给妈妈打电话",
]
MAX_NEW = 6
STOP = [151645, 151643]


def _conv(question: str, answer: str | None) -> list[dict]:
    msgs = [{"role": "user", "content": f"请你判读用户的意图。交互历史：用户：{question}"}]
    return msgs + ([{"role": "assistant", "content": answer}] if answer is not None else [])


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_dir: Path) -> dict:
    root = tmp_path_factory.mktemp("eval_moe")
    config = Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        norm_topk_prob=True,
        initializer_range=0.5,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(config).eval()
    hf.save_pretrained(root / "hf")
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    answers = []
    for q in QUESTIONS:  # transformers' greedy answer to the prompt the eval job renders
        prompt = encode_prompt(tok, _conv(q, None), "qwen3", "none")
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=STOP, pad_token_id=STOP[1]
            )
        answers.append(tok.decode(out[0, len(prompt) :], skip_special_tokens=True))
    lines = [json.dumps({"messages": _conv(q, a)}, ensure_ascii=False) for q, a in zip(QUESTIONS, answers, strict=True)]
    (root / "test.jsonl").write_text("\n".join(lines) + "\n")
    mg = root / "mg"
    flags = ["--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "qwen3-moe"]
    flags += ["--target-expert-parallel-size", "2", "--moe-grouped-gemm"]
    code = main(
        ["convert", *flags, "--load-dir", str(root / "hf"), "--save-dir", str(mg), "--run-dir", str(root / "c")]
    )
    assert code == EXIT_OK
    assert (mg / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt").is_file()
    return {"root": root, "data": root / "test.jsonl", "tok": str(qwen_tokenizer_dir), "answers": answers, "hf": hf}


def _eval(setup: dict, load: str, run_dir: Path, *extra: str) -> dict:
    code = main(
        [
            "eval",
            *("--load", str(setup["root"] / load), "--tokenizer-name-or-path", setup["tok"]),
            *("--eval-data-path", str(setup["data"]), "--max-new-tokens", str(MAX_NEW)),
            *("--temperature", "0.00001", "--run-dir", str(run_dir), *extra),
        ]
    )
    assert code == EXIT_OK, (run_dir / "events.jsonl").read_text()
    return json.loads((run_dir / "result.json").read_text())


@pytest.mark.parametrize("load", ["hf", "mg"])
def test_greedy_generation_equals_transformers(setup: dict, tmp_path: Path, load: str) -> None:
    result = _eval(setup, load, tmp_path, "--eval-batch-size", "3")
    rows = [json.loads(x) for x in Path(result["outputs"]["predictions"]).read_text().splitlines()]
    assert [r["answer"] for r in rows] == [a.strip() for a in setup["answers"]]
    assert result["summary"]["correct"] == len(QUESTIONS)
    assert len({a for a in setup["answers"]}) > 1  # the answers are not one degenerate string


@pytest.fixture(scope="module")
def hf_loss(setup: dict) -> tuple[float, int]:
    """transformers' mean loss over the answers' tokens and their count: both loads are compared with it."""
    tok = AutoTokenizer.from_pretrained(setup["tok"])
    total, count = 0.0, 0
    for line in setup["data"].read_text().splitlines():
        ids, labels = encode_conversation(tok, json.loads(line)["messages"], "qwen3", "none")
        with torch.no_grad():
            loss = setup["hf"](input_ids=torch.tensor(ids[None]).long(), labels=torch.tensor(labels[None]).long()).loss
        n = int((labels[1:] != -100).sum())
        total, count = total + float(loss) * n, count + n
    return total / count, count


@pytest.mark.parametrize("load", ["hf", "mg"])
def test_loss_mode_equals_transformers(setup: dict, hf_loss: tuple[float, int], tmp_path: Path, load: str) -> None:
    s = _eval(setup, load, tmp_path, "--eval-mode", "loss", "--eval-batch-size", "4")["summary"]
    assert s["tokens"] == hf_loss[1]
    assert s["loss"] == pytest.approx(hf_loss[0], rel=1e-5)
