"""Tensor-parallel serving (issue 24): ``python -m engine serve`` on two gloo ranks (TP 2) answers concurrent requests
with the same greedy tokens as ``transformers.generate``, prefill chunks and decode steps interleaved, and ends
cleanly on its idle timeout (rank 0's loop ends the follower's)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import Qwen3ForCausalLM

from tests.convert_tiny import real_vocab_qwen3
from torchrun_support import REPO, torchrun

pytestmark = pytest.mark.slow
PROMPTS = [
    [9707, 11, 1879, 0],
    [785, 3974, 13876, 38835, 34208, 916, 279, 15678],
    [40, 1079],
    [3838, 374, 220, 17, 10, 17, 30],
]
MAX_NEW = 6


def _generate(url: str, ids: list[int]) -> list[int]:
    body = {"prompt_token_ids": ids, "max_tokens": MAX_NEW, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [json.loads(x) for x in r.iter_lines() if x]
    return [x["token_id"] for x in lines if x["type"] == "token"]


def _hf_greedy(model_dir: Path, ids: list[int]) -> list[int]:
    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=[151645, 151643])
    return out[0, len(ids) :].tolist()


def test_tp2_serving_equals_transformers_greedy(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    torch.manual_seed(3)
    model = real_vocab_qwen3(tmp_path / "hf", initializer_range=0.5)
    spec = {
        "kind": "serve",
        "load": str(model),
        "tokenizer_name_or_path": str(qwen_tokenizer_dir),
        "tensor_model_parallel_size": 2,
        "max_num_seqs": 3,
        "max_model_len": 64,
        "idle_timeout_s": 4,
        "resources": {"nproc_per_node": 2},
    }
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = torchrun(2, "-m", "engine", "serve", "--spec", str(run_dir / "spec.json"), "--run-dir", str(run_dir))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "serve.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.3)
        url = json.loads((run_dir / "serve.json").read_text())["url"]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # more requests than slots: some wait, batches change
            served = list(pool.map(lambda ids: _generate(url, ids), PROMPTS))
        output, _ = proc.communicate(timeout=120)  # the idle timeout ends rank 0, whose loop ends rank 1's
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    stop = {151645, 151643}
    for ids, got in zip(PROMPTS, served, strict=True):
        want = _hf_greedy(model, ids)
        cut = next((i for i, t in enumerate(want) if t in stop), len(want))
        assert got[: cut + 1] == want[: cut + 1], (ids, got, want)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["summary"]["requests"] == len(PROMPTS) and result["summary"]["tensor_model_parallel_size"] == 2
    replayed = [line for line in output.splitlines() if "TP rank 1 replayed" in line]
    assert replayed and int(replayed[0].split("replayed ")[1].split()[0]) >= len(PROMPTS) * 2, output[-3000:]
