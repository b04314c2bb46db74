"""Megatron-Core's own GPTModel (local spec, qk-layernorm) accepts our mcore shards: on every (TP, PP) rank the
key set and shapes are exactly what it declares, they load with only ``_extra_state`` missing, and at PP=1 its
forward on CPU gives transformers' logits (megatron-core-on-cpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from convert_tiny import VOCAB, hf_logits, json_objects, tiny_hf  # noqa: E402
from engine.checkpoint.hf import HFCheckpoint  # noqa: E402
from engine.checkpoint.megatron import save_mcore  # noqa: E402

pytest.importorskip("megatron.core")
WORKER = Path(__file__).with_name("mcore_oracle_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,tied", [(2, 2, False), (2, 2, True), (2, 1, True)], ids=["tp2pp2", "tp2pp2-tied", "tp2-tied-forward"]
)
def test_megatron_core_gptmodel_accepts_our_shards(tmp_path: Path, tp: int, pp: int, tied: bool) -> None:
    hf = tiny_hf(tmp_path / "hf", tied=tied)
    src = HFCheckpoint(hf)
    save_mcore(src, src.config, tmp_path / "mg", tp=tp, pp=pp)
    cfg = src.config
    shape = {
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_query_groups": cfg.num_query_groups,
        "kv_channels": cfg.kv_channels,
        "vocab_size": VOCAB,
        "tie_word_embeddings": tied,
        "rotary_base": cfg.rotary_base,
    }
    argv = [str(tmp_path / "mg"), str(tp), str(pp), json.dumps(shape)]
    if pp == 1:
        ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
        torch.save({"ids": ids, "logits": hf_logits(hf, ids)}, tmp_path / "ref.pt")
        argv.append(str(tmp_path / "ref.pt"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(tp * pp),
            str(WORKER),
            *argv,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    lines = json_objects(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [r for r in lines if "ok" in r]
    assert len(ranks) == tp * pp and all(r["ok"] for r in ranks), lines
    if pp == 1:
        assert all(r["max_logit_diff"] < 1e-4 for r in lines if "max_logit_diff" in r)
