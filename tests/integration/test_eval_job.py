"""The eval job end to end on a tiny random Qwen3 saved as an HF directory: known-answer accuracy, predictions file,
bad-line policies, checkpoint/flag mismatch, loss mode against transformers, and the seed's command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from engine.cli import main
from engine.contract.model_config import preset
from engine.contract.runfiles import EXIT_BAD_INPUT, EXIT_OK
from engine.data.templates import encode_conversation, encode_prompt

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
QUESTIONS = [
    "广州塔为什么也叫小蛮腰",
    "play jazz",
    "明天北京天气怎么样？请告诉我",
    "turn off the lights in the kitchen",
    "hi",
    "设置一个早上七点的闹钟",
    "what's 2+2",
    "给妈妈打电话",
]
MAX_NEW = 4
N_RIGHT = 5  # the first N_RIGHT lines get the model's own greedy answer as reference


def _conv(question: str, answer: str | None) -> dict:
    msgs = [SYSTEM, {"role": "user", "content": f"请你判读用户的意图。交互历史：用户：{question}"}]
    return {"messages": msgs + ([{"role": "assistant", "content": answer}] if answer is not None else [])}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, qwen_tokenizer_dir: Path) -> dict:
    root = tmp_path_factory.mktemp("eval")
    cfg = preset("qwen3-tiny")
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**{**cfg.to_hf("float32"), "initializer_range": 0.5})).eval()
    hf.save_pretrained(root / "hf")
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    answers = []
    for q in QUESTIONS:  # transformers' greedy answer to the prompt the eval job will render
        prompt = encode_prompt(tok, _conv(q, None)["messages"], "qwen3", "none")
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=[151645, 151643],
                pad_token_id=151643,
            )
        answers.append(tok.decode(out[0, len(prompt) :], skip_special_tokens=True))
    lines = [_conv(q, a if i < N_RIGHT else f"WRONG_{i}") for i, (q, a) in enumerate(zip(QUESTIONS, answers))]
    text = [json.dumps(x, ensure_ascii=False) for x in lines]
    text.insert(3, json.dumps(_conv("no answer here", None), ensure_ascii=False))  # line 4: no assistant answer
    text.insert(6, "{not json")  # line 7
    (root / "test.jsonl").write_text("\n".join(text) + "\n")
    return {
        "root": root,
        "hf": root / "hf",
        "data": root / "test.jsonl",
        "tok": str(qwen_tokenizer_dir),
        "answers": answers,
        "hf_model": hf,
        "tokenizer": tok,
    }


def _eval(setup: dict, run_dir: Path, *extra: str) -> int:
    return main(
        [
            "eval",
            "--load",
            str(setup["hf"]),
            "--tokenizer-name-or-path",
            setup["tok"],
            "--eval-data-path",
            str(setup["data"]),
            "--max-new-tokens",
            str(MAX_NEW),
            "--temperature",
            "0.00001",
            "--run-dir",
            str(run_dir),
            *extra,
        ]
    )


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def greedy(setup, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One greedy eval of the loaded checkpoint (batches of 3, KV cache on): the known answers, the deployment and
    the no-KV-cache tests all compare against this run."""
    run_dir = tmp_path_factory.mktemp("greedy")
    assert _eval(setup, run_dir, "--eval-batch-size", "3") == EXIT_OK
    return run_dir


def test_known_answers_accuracy_and_predictions(setup, greedy: Path) -> None:
    tmp_path = greedy
    result = json.loads((tmp_path / "result.json").read_text())
    s = result["summary"]
    assert (s["total"], s["correct"], s["skipped"]) == (8, N_RIGHT, 2)
    assert s["accuracy"] == pytest.approx(N_RIGHT / 8)
    assert [b["line"] for b in s["skipped_lines"]] == [4, 7]
    assert "no assistant answer" in s["skipped_lines"][0]["reason"]
    assert s["tokens_per_s"] > 0 and s["generated_tokens"] == 8 * MAX_NEW
    assert {x["count"] for x in s["confusion"]} == {1} and len(s["confusion"]) == 3
    rows = [json.loads(x) for x in Path(result["outputs"]["predictions"]).read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3, 5, 6, 8, 9, 10]
    assert all({"input", "reference", "output", "answer", "correct"} <= set(r) for r in rows)
    assert [r["correct"] for r in rows] == [True] * N_RIGHT + [False] * 3
    assert [r["answer"] for r in rows] == [a.strip() for a in setup["answers"]]
    assert rows[0]["input"].endswith(QUESTIONS[0])
    events = _events(tmp_path)
    progress = [e for e in events if e["type"] == "progress"]
    assert progress and progress[-1]["data"]["done"] == progress[-1]["data"]["total"] == 8
    assert sum(e["type"] == "warning" and "skipped" in e["message"] for e in events) == 2


def test_eval_through_a_deployment_equals_the_loaded_model(setup, greedy: Path, tmp_path: Path) -> None:
    """Issue 24 item 6: the same eval generated through a running serve engine (``deployment_url``) instead of a
    loaded checkpoint: the same greedy answers, accuracy and predictions, four prompts in flight at once."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from serve_support import running_engine

    serve = {"load": str(setup["hf"]), "tokenizer_name_or_path": setup["tok"], "max_num_seqs": 4, "max_model_len": 256}
    with running_engine(tmp_path / "serve", **serve) as (url, _):
        flags = ["--tokenizer-name-or-path", setup["tok"], "--eval-data-path", str(setup["data"])]
        flags += ["--max-new-tokens", str(MAX_NEW), "--temperature", "0.00001", "--eval-batch-size", "4"]
        assert main(["eval", "--deployment-url", url, *flags, "--run-dir", str(tmp_path / "remote")]) == EXIT_OK
    loaded, remote = (json.loads((d / "result.json").read_text()) for d in (greedy, tmp_path / "remote"))
    for key in ("total", "correct", "skipped", "accuracy", "generated_tokens", "stopped_by_length"):
        assert remote["summary"][key] == loaded["summary"][key], key
    assert remote["summary"]["model"]["deployment_url"] == url
    rows = [
        [json.loads(x) for x in Path(r["outputs"]["predictions"]).read_text().splitlines()] for r in (loaded, remote)
    ]
    assert rows[0] == rows[1]


def test_no_kv_cache_and_batch_1_give_the_same_predictions(setup, greedy: Path, tmp_path: Path) -> None:
    """Against the shared run's batches of 3 (padded to their longest prompt, KV cache on)."""
    assert _eval(setup, tmp_path, "--no-kv-cache") == EXIT_OK  # micro_batch_size 1
    a, b = ((d / "predictions.jsonl").read_text() for d in (greedy, tmp_path))
    assert a == b


def test_seeded_sampling_is_reproducible(setup, tmp_path: Path) -> None:
    sample = ["--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--eval-batch-size", "4"]
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        assert _eval(setup, tmp_path / name, *sample, "--seed", seed) == EXIT_OK
    a, b, c = ((tmp_path / d / "predictions.jsonl").read_text() for d in "abc")
    assert a == b and a != c
    s = json.loads((tmp_path / "a" / "result.json").read_text())["summary"]
    assert s["decoding"]["greedy"] is False and s["decoding"]["top_k"] == 50


def test_bad_line_policy_error_fails_naming_the_line(setup, tmp_path: Path) -> None:
    assert _eval(setup, tmp_path, "--bad-line-policy", "error") == EXIT_BAD_INPUT
    error = next(e for e in _events(tmp_path) if e["type"] == "error")
    assert "test.jsonl:4" in error["message"] and "no assistant answer" in error["message"]
    assert error["data"]["field"] == "eval_data_path"


def test_checkpoint_not_matching_the_flags_is_a_clear_error(setup, tmp_path: Path) -> None:
    code = _eval(setup, tmp_path, "--num-layers", "36", "--hidden-size", "64")
    assert code == EXIT_BAD_INPUT
    error = next(e for e in _events(tmp_path) if e["type"] == "error")
    assert error["message"].startswith("num_layers: the spec says 36 but the checkpoint")
    assert "num_layers=2" in error["message"]
    assert error["data"]["field"] == "num_layers"


def test_loss_mode_matches_transformers(setup, tmp_path: Path) -> None:
    assert _eval(setup, tmp_path, "--eval-mode", "loss", "--eval-batch-size", "4") == EXIT_OK
    s = json.loads((tmp_path / "result.json").read_text())["summary"]
    total, count = 0.0, 0
    for line in setup["data"].read_text().splitlines():
        try:
            msgs = json.loads(line)["messages"]
        except json.JSONDecodeError:
            continue
        if msgs[-1]["role"] != "assistant":
            continue
        ids, labels = encode_conversation(setup["tokenizer"], msgs, "qwen3", "none")
        with torch.no_grad():
            loss = setup["hf_model"](
                input_ids=torch.tensor(ids[None]).long(), labels=torch.tensor(labels[None]).long()
            ).loss
        n = int((labels[1:] != -100).sum())
        total, count = total + float(loss) * n, count + n
    assert s["tokens"] == count and s["skipped"] == 2
    assert s["loss"] == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize("pack", [False, True], ids=["unpacked", "packed"])
def test_loss_mode_on_an_indexed_dataset_equals_the_jsonl(setup, tmp_path: Path, pack: bool) -> None:
    """Packed rows too: attention stays inside each sub-sample and no token predicts the next sub-sample's first."""
    good = [x for x in setup["data"].read_text().splitlines() if x.startswith("{") and '"assistant"' in x]
    (tmp_path / "good.jsonl").write_text("\n".join(good) + "\n")
    prep = {
        "kind": "preprocess",
        "input": str(tmp_path / "good.jsonl"),
        "tokenizer_name_or_path": setup["tok"],
        "output_prefix": str(tmp_path / "idx" / "test"),
        "prompt_type": "qwen3",
        "handler_name": "SharegptStyleInstructionHandler",
        **({"pack": True, "seq_length": 256} if pack else {}),
    }
    (tmp_path / "prep.json").write_text(json.dumps(prep))
    assert main(["preprocess", "--spec", str(tmp_path / "prep.json"), "--run-dir", str(tmp_path / "prep")]) == EXIT_OK
    base = [
        "eval",
        "--load",
        str(setup["hf"]),
        "--tokenizer-name-or-path",
        setup["tok"],
        "--eval-mode",
        "loss",
        "--eval-batch-size",
        "3",
    ]
    assert (
        main([*base, "--eval-data-path", str(tmp_path / "idx" / "test"), "--run-dir", str(tmp_path / "a")]) == EXIT_OK
    )
    assert main([*base, "--eval-data-path", str(tmp_path / "good.jsonl"), "--run-dir", str(tmp_path / "b")]) == EXIT_OK
    a, b = (json.loads((tmp_path / d / "result.json").read_text())["summary"] for d in "ab")
    assert b["sequences"] == len(good) and a["tokens"] == b["tokens"]
    assert a["sequences"] < len(good) if pack else a["sequences"] == len(good)  # packed: fewer, longer rows
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_seed_command_line(setup, tmp_path: Path) -> None:
    """eval_qwen3_4B_full_customed10k.sh's flags (paths changed, the tiny model's shape) through the CLI's ``main``,
    in this process: a fresh interpreter's imports were most of this test's time, and ``python -m engine`` only
    raises SystemExit with main's code (started by train_support.run_train's one-process runs, e.g. test_train_dp)."""
    cfg = preset("qwen3-tiny")
    argv = [
        "--use-mcore-models",
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "1",
        "--load",
        str(setup["hf"]),
        "--spec",
        "mindspeed_llm.tasks.models.spec.qwen3_spec",
        "layer_spec",
        "--kv-channels",
        str(cfg.kv_channels),
        "--qk-layernorm",
        "--num-layers",
        str(cfg.num_layers),
        "--hidden-size",
        str(cfg.hidden_size),
        "--use-rotary-position-embeddings",
        "--untie-embeddings-and-output-weights",
        "--num-attention-heads",
        str(cfg.num_attention_heads),
        "--ffn-hidden-size",
        str(cfg.ffn_hidden_size),
        "--max-position-embeddings",
        str(cfg.max_position_embeddings),
        "--seq-length",
        "800",
        "--make-vocab-size-divisible-by",
        "1",
        "--padded-vocab-size",
        "151936",
        "--rotary-base",
        "1000000",
        "--micro-batch-size",
        "1",
        "--disable-bias-linear",
        "--swiglu",
        "--tokenizer-type",
        "PretrainedFromHF",
        "--tokenizer-name-or-path",
        setup["tok"],
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--norm-epsilon",
        "1e-6",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--max-new-tokens",
        str(MAX_NEW),
        "--no-gradient-accumulation-fusion",
        "--attention-softmax-in-fp32",
        "--exit-on-missing-checkpoint",
        "--no-masked-softmax-fusion",
        "--group-query-attention",
        "--num-query-groups",
        str(cfg.num_query_groups),
        "--seed",
        "42",
        "--eval-data-path",
        str(setup["data"]),
        "--eval-data-size",
        "1000",
        "--temperature",
        "0.00001",
    ]
    assert main(["eval", *argv, "--run-dir", str(tmp_path)]) == EXIT_OK
    assert "accuracy 0.6250 (5/8)" in (tmp_path / "logs" / "rank0.log").read_text()  # the log stderr also gets
    s = json.loads((tmp_path / "result.json").read_text())["summary"]
    assert s["accuracy"] == pytest.approx(N_RIGHT / 8) and (tmp_path / "predictions.jsonl").is_file()
