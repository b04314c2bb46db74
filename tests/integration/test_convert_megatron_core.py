"""Megatron-Core's own GPTModel (local spec, qk-layernorm) accepts our mcore shards: on every (TP, PP) rank the
key set and shapes are exactly what it declares, they load with only ``_extra_state`` missing, and at PP=1 its
forward on CPU gives transformers' logits (docs/megatron-core-on-cpu.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from convert_tiny import VOCAB, hf_logits, json_objects, tiny_hf  # noqa: E402
from engine.checkpoint.hf import HFCheckpoint  # noqa: E402
from engine.checkpoint.megatron_write import save_mcore  # noqa: E402
from mcore_cpu_support import mcore_shape  # noqa: E402
from torchrun_support import run_ok, torchrun  # noqa: E402

pytest.importorskip("megatron.core")
WORKER = Path(__file__).with_name("mcore_oracle_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,tied", [(2, 2, False), (2, 2, True), (2, 1, True)], ids=["tp2pp2", "tp2pp2-tied", "tp2-tied-forward"]
)
def test_megatron_core_gptmodel_accepts_our_shards(tmp_path: Path, tp: int, pp: int, tied: bool) -> None:
    hf = tiny_hf(tmp_path / "hf", tied=tied)
    src = HFCheckpoint(hf)
    save_mcore(src, src.config, tmp_path / "mg", tp=tp, pp=pp)
    cfg = src.config
    shape = mcore_shape(cfg, vocab_size=VOCAB, tie_word_embeddings=tied, rotary_base=cfg.rotary_base)
    argv = [str(tmp_path / "mg"), str(tp), str(pp), json.dumps(shape)]
    if pp == 1:
        ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
        torch.save({"ids": ids, "logits": hf_logits(hf, ids)}, tmp_path / "ref.pt")
        argv.append(str(tmp_path / "ref.pt"))
    proc = run_ok(torchrun(tp * pp, str(WORKER), *argv), timeout=300)
    lines = json_objects(proc.stdout)
    ranks = [r for r in lines if "ok" in r]
    assert len(ranks) == tp * pp and all(r["ok"] for r in ranks), lines
    if pp == 1:
        assert all(r["max_logit_diff"] < 1e-4 for r in lines if "max_logit_diff" in r)
