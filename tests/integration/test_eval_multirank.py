"""``python -m engine eval`` under torchrun with 2 ranks (gloo): the test set is split across ranks, rank 0 gathers,
and the predictions equal a one-process run. The seed's PP=2 layout is accepted and reported (eval replicates the
model instead of sharding it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.checkpoint.hf import save_hf
from engine.contract.model_config import preset
from engine.model.qwen3 import Qwen3Model
from torchrun_support import main_in_process, run_ok, torchrun

pytestmark = pytest.mark.slow


def _lines(n: int) -> str:
    out = []
    for i in range(n):
        msgs = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "请你判读用户的意图。交互历史：用户：" + "播放音乐" * (1 + i % 4)},
            {"role": "assistant", "content": "音乐_播放"},
        ]
        out.append(json.dumps({"messages": msgs}, ensure_ascii=False))
    out.insert(2, json.dumps({"messages": msgs[:2]}, ensure_ascii=False))  # a bad line: no answer
    return "\n".join(out) + "\n"


def _run(cmd: list[str], run_dir: Path) -> dict:
    run_ok([*cmd, "--run-dir", str(run_dir)], timeout=300)
    return json.loads((run_dir / "result.json").read_text())


def run_one(args: list[str], run_dir: Path) -> dict:
    """The one-process eval, in this process (``main_in_process``: a fresh interpreter's imports were most of it)."""
    main_in_process([*args, "--run-dir", str(run_dir)], run_dir)
    return json.loads((run_dir / "result.json").read_text())


def eval_args(tmp_path: Path, tokenizer: Path, model: str, seed: int, samples: int, new_tokens: int) -> list[str]:
    """A random tiny HF model, a test set of ``samples`` lines (+1 bad) and greedy eval flags over them."""
    cfg = preset(model)
    weights = Qwen3Model(cfg)
    weights.init_weights(seed=seed)
    save_hf(weights.state_dict(), cfg, tmp_path / "hf", dtype=torch.float32)
    (tmp_path / "test.jsonl").write_text(_lines(samples))
    return [
        "eval",
        "--load",
        str(tmp_path / "hf"),
        "--tokenizer-name-or-path",
        str(tokenizer),
        "--eval-data-path",
        str(tmp_path / "test.jsonl"),
        "--max-new-tokens",
        str(new_tokens),
        "--temperature",
        "0.00001",
        "--eval-batch-size",
        "2",
    ]


def test_two_ranks_split_the_test_set_and_match_one_process(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    args = eval_args(tmp_path, qwen_tokenizer_dir, "qwen3-tiny-tied", seed=5, samples=7, new_tokens=3)
    single = run_one(args, tmp_path / "one")
    tp1pp2 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
    multi = _run(torchrun(2, "-m", "engine", *args, *tp1pp2), tmp_path / "two")
    assert multi["summary"]["world_size"] == 2 and single["summary"]["world_size"] == 1
    assert multi["summary"]["total"] == single["summary"]["total"] == 7 and multi["summary"]["skipped"] == 1
    assert (tmp_path / "one" / "predictions.jsonl").read_text() == (tmp_path / "two" / "predictions.jsonl").read_text()
    events = [json.loads(x) for x in (tmp_path / "two" / "events.jsonl").read_text().splitlines()]
    assert any(e["type"] == "warning" and "does not shard the model" in e["message"] for e in events)
