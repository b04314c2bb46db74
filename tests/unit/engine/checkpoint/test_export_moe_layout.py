"""The trainer's final mcore export of a Qwen3-MoE with ``--moe-grouped-gemm``: MindSpeed's GroupedMLP tensors
(``mlp.experts.weight1``/``weight2``), written by the conversion's plan, read back equal to the HF export."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from engine.checkpoint.hf import HFCheckpoint  # noqa: E402
from engine.checkpoint.megatron_read import MegatronCheckpoint  # noqa: E402
from engine.contract.runfiles import RunDir  # noqa: E402
from engine.contract.spec import parse_spec  # noqa: E402
from engine.train import entry  # noqa: E402
from train_support import tiny_spec, write_instruction_data  # noqa: E402

MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_layer_freq": [1, 0]}


def test_grouped_export_is_mindspeeds_layout(tmp_path: Path) -> None:
    data = write_instruction_data(tmp_path / "data" / "sft", n=8)
    spec = tiny_spec(data, **MOE, moe_grouped_gemm=True, train_iters=2, global_batch_size=4)
    spec.update(save=str(tmp_path / "save"), save_hf=True)
    outputs, _ = entry.run(parse_spec(spec), RunDir(tmp_path / "run"))
    stored = torch.load(Path(outputs["checkpoint_dir"]) / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    model = stored["model"]
    assert model["decoder.layers.0.mlp.experts.weight1"].shape == (64, 4 * 2 * 32)  # (H, E·2F)
    assert model["decoder.layers.0.mlp.experts.weight2"].shape == (4 * 32, 64)  # (E·F, H)
    assert not any("local_experts" in k for k in model) and stored["args"].moe_grouped_gemm is True
    mcore, hf = MegatronCheckpoint(outputs["checkpoint"]), HFCheckpoint(outputs["hf"])
    for key in ("decoder.layers.0.mlp.experts.linear_fc1.weight", "decoder.layers.0.mlp.experts.linear_fc2.weight"):
        assert torch.equal(mcore.get_native(key), hf.get_native(key))
