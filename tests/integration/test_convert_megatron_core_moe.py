"""Megatron-Core's own Qwen3-MoE-shaped GPTModel (local spec, dense layer mixed in) accepts our MindSpeed-layout MoE
shards: SequentialMLP and GroupedMLP experts, TP and EP ranks (``mcore_moe_oracle_worker.py``); at TP = EP = 1 its
CPU forward gives transformers' logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from moe_support import VOCAB, hf_config  # noqa: E402

from convert_tiny import json_objects  # noqa: E402
from engine.checkpoint.hf import HFCheckpoint  # noqa: E402
from engine.checkpoint.megatron_write import save_mcore  # noqa: E402
from mcore_cpu_support import mcore_shape  # noqa: E402
from torchrun_support import run_ok, torchrun  # noqa: E402

pytest.importorskip("megatron.core")
WORKER = Path(__file__).with_name("mcore_moe_oracle_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,ep,grouped",
    [(1, 1, False), (1, 2, True), (2, 2, False), (2, 1, True)],
    ids=["seq", "ep2-grouped", "tp2ep2", "tp2-grouped"],
)
def test_megatron_core_moe_accepts_our_shards(tmp_path: Path, tp: int, ep: int, grouped: bool) -> None:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(hf_config(norm_topk_prob=True)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)  # a wide router: tokens spread over the experts
    hf.save_pretrained(tmp_path / "hf")
    src = HFCheckpoint(tmp_path / "hf")
    save_mcore(src, src.config, tmp_path / "mg", tp=tp, ep=ep, grouped=grouped)
    cfg = src.config
    shape = mcore_shape(
        cfg,
        num_experts=cfg.num_experts,
        topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.expert_ffn_hidden_size,
        moe_layer_freq=[int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)],
        vocab_size=VOCAB,
        rotary_base=cfg.rotary_base,
    )
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = hf(ids).logits
    p = "model.layers.0.mlp.experts."
    experts = [
        {n: src.get(f"{p}{e}.{n}_proj.weight") for n in ("gate", "up", "down")} for e in range(cfg.num_experts or 0)
    ]
    torch.save({"ids": ids, "logits": logits, "experts": experts}, tmp_path / "ref.pt")
    argv = [str(tmp_path / "mg"), str(tp), str(ep), str(int(grouped)), json.dumps(shape), str(tmp_path / "ref.pt")]
    proc = run_ok(torchrun(tp * ep, str(WORKER), *argv), timeout=600)
    lines = json_objects(proc.stdout)  # the ranks' lines may run together
    assert sum(1 for x in lines if x.get("ok")) == tp * ep, lines
    if tp == ep == 1 and not grouped:
        assert any("max_logit_diff" in x for x in lines)
