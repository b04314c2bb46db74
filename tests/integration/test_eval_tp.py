"""``python -m engine eval`` under torchrun with ``--tensor-model-parallel-size 2`` (gloo): the model is sharded with
the trainer's TP plan (vocab-parallel embedding and head, KV cache of the local KV groups), the head's logits are
gathered across the TP group, and greedy predictions equal a one-process run — for the dense and the MoE model
(experts cut per expert: ``engine.parallel.tensor_parallel.ExpertTensorParallel``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_eval_multirank import _run, eval_args, run_one
from torchrun_support import torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_tensor_parallel_eval_matches_one_process(tmp_path: Path, qwen_tokenizer_dir: Path, model: str) -> None:
    # untied: the head is its own vocab-parallel output_layer; the MoE model's experts are cut per expert
    args = eval_args(tmp_path, qwen_tokenizer_dir, model, seed=7, samples=5, new_tokens=4)
    single = run_one(args, tmp_path / "one")
    multi = _run(torchrun(2, "-m", "engine", *args, "--tensor-model-parallel-size", "2"), tmp_path / "tp")
    assert multi["summary"]["world_size"] == 2 and multi["summary"]["tensor_model_parallel_size"] == 2
    assert multi["summary"]["total"] == single["summary"]["total"] == 5
    assert multi["summary"]["generated_tokens"] == single["summary"]["generated_tokens"]
    assert (tmp_path / "one" / "predictions.jsonl").read_text() == (tmp_path / "tp" / "predictions.jsonl").read_text()
    events = [json.loads(x) for x in (tmp_path / "tp" / "events.jsonl").read_text().splitlines()]
    assert not any(e["type"] == "warning" and "does not shard the model" in e["message"] for e in events)
