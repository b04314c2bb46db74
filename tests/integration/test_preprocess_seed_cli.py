"""The seed's preprocessing command line, unchanged but for paths, through ``python -m engine preprocess``.

It must produce the seed's six files, readable by Megatron-Core's IndexedDataset with the expected tokens and masks,
with worker processes giving the same bytes as one process, and the spec-file form giving the same result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from engine.contract.constants import IGNORE_INDEX
from engine.contract.indexed import instruction_prefix
from engine.data.templates import encode_conversation
from engine.data.tokenizer import load_tokenizer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SEED_MAP = '{"messages":"messages", "tags":{"role_tag": "role","content_tag": "content","user_tag": "user","assistant_tag": "assistant","system_tag": "system"}}'
SEED_FILES = sorted(
    f"customed_packed_{f}_document.{s}" for f in ("attention_mask", "input_ids", "labels") for s in ("bin", "idx")
)


def conversation(i: int) -> dict:
    history = "".join(f"用户：问题{j}的内容是什么\n" for j in range(1 + i % 9))
    return {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"请你判读用户的意图。交互历史：{history}用户最后一句话所属的技能和意图是："},
            {"role": "assistant", "content": f"技能{i % 4}_意图{i % 3}"},
        ]
    }


def engine(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "engine", "preprocess", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    (root / "datasets").mkdir()
    lines = [json.dumps(conversation(i), ensure_ascii=False) for i in range(1500)]
    (root / "datasets" / "customed_train_10k.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def seed_command(tok_dir: Path, out: str, workers: int) -> list[str]:
    # data_convert_qwen3_instruction_customed10k_qwen3.sh, with the paths changed
    return [
        "--input",
        "datasets/customed_train_10k.jsonl",
        "--tokenizer-name-or-path",
        str(tok_dir),
        "--output-prefix",
        f"{out}/finetune_dataset_customed10k_qwen3_think/customed",
        "--handler-name",
        "SharegptStyleInstructionHandler",
        "--tokenizer-type",
        "PretrainedFromHF",
        "--enable-thinking",
        "true",
        "--workers",
        str(workers),
        "--log-interval",
        "1000",
        "--map-keys",
        SEED_MAP,
        "--prompt-type",
        "qwen3",
    ]


def test_seed_command_line_produces_the_seed_files(dataset, qwen_tokenizer_dir):
    done = engine([*seed_command(qwen_tokenizer_dir, "out4", 4), "--run-dir", "run4"], dataset)
    assert done.returncode == 0, done.stderr
    out = dataset / "out4" / "finetune_dataset_customed10k_qwen3_think"
    assert sorted(p.name for p in out.iterdir()) == SEED_FILES
    prefix = str(out / "customed")
    ids, labels, mask = (
        MegatronIndexedDataset(instruction_prefix(prefix, f)) for f in ("input_ids", "labels", "attention_mask")
    )
    assert len(ids) == len(labels) == len(mask) == 1500
    assert ids.document_indices.tolist() == list(range(1501))
    tok = load_tokenizer(str(qwen_tokenizer_dir))
    for i in (0, 1, 777, 1499):
        want_ids, want_labels = encode_conversation(tok, conversation(i)["messages"], "qwen3", "true")
        assert ids[i].tolist() == want_ids.tolist() and labels[i].tolist() == want_labels.tolist()
        assert set(mask[i].tolist()) == {1}
        trained = tok.decode([t for t in labels[i].tolist() if t != IGNORE_INDEX])
        assert trained == f"<think>\n\n</think>\n\n技能{i % 4}_意图{i % 3}<|im_end|>\n"
    result = json.loads((dataset / "run4" / "result.json").read_text())
    assert result["outputs"]["data_path"] == prefix
    assert result["summary"]["samples_written"] == 1500
    events = [json.loads(line) for line in (dataset / "run4" / "events.jsonl").read_text().splitlines()]
    assert events[0]["type"] == "started" and events[-1]["type"] == "finished"
    assert any(e["type"] == "progress" and e["data"]["done"] == 1500 for e in events)

    # One process writes the same bytes as four, and the spec-file form runs the same job.
    (dataset / "spec.json").write_text(
        json.dumps(
            {
                "kind": "preprocess",
                "input": "datasets/customed_train_10k.jsonl",
                "tokenizer_name_or_path": str(qwen_tokenizer_dir),
                "output_prefix": "out1/customed",
                "handler_name": "SharegptStyleInstructionHandler",
                "enable_thinking": "true",
                "map_keys": json.loads(SEED_MAP),
                "prompt_type": "qwen3",
                "workers": 1,
                "log_interval": 1000,
            }
        )
    )
    done = engine(["--spec", "spec.json", "--run-dir", "run1"], dataset)
    assert done.returncode == 0, done.stderr
    for name in SEED_FILES:
        assert (dataset / "out1" / name).read_bytes() == (out / name).read_bytes(), name


def test_bad_line_exits_2_naming_file_and_line(dataset, qwen_tokenizer_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = (dataset / "datasets" / "customed_train_10k.jsonl").read_text(encoding="utf-8").splitlines()[:900]
    lines[812] = lines[812][:-5]  # truncated JSON
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = seed_command(qwen_tokenizer_dir, str(tmp_path / "o"), 2)
    args[1] = str(bad)
    done = engine([*args, "--run-dir", str(tmp_path / "run")], tmp_path)
    assert done.returncode == 2
    assert "bad.jsonl, line 813: malformed JSON" in done.stderr
    assert not list((tmp_path / "o" / "finetune_dataset_customed10k_qwen3_think").iterdir())
    done = engine([*args, "--skip-bad-samples", "--run-dir", str(tmp_path / "run2")], tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run2" / "result.json").read_text())["summary"]
    assert summary["bad_samples_skipped"] == 1 and summary["samples_written"] == 899
