"""A LoRA run on a Qwen3-MoE (adapters on attention and on every expert, stacked) merged by ``convert --lora-load``:
onto its HF base and onto the base converted to MindSpeed's mcore layout (EP 2, grouped experts), both give the
same HF model, and that model computes what the trained (unmerged) LoRA model computes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from moe_support import write_hf_moe_dir  # noqa: E402

from engine.checkpoint.hf import HFCheckpoint  # noqa: E402
from engine.cli import main  # noqa: E402
from engine.contract.model_config import ModelConfig  # noqa: E402
from engine.contract.runfiles import EXIT_OK, RunDir  # noqa: E402
from engine.contract.spec import parse_spec  # noqa: E402
from engine.model.lora import apply_lora, load_lora_state_dict  # noqa: E402
from engine.model.qwen3 import Qwen3Model  # noqa: E402
from engine.train import entry  # noqa: E402
from train_support import TINY_SHAPE, tiny_spec, write_instruction_data  # noqa: E402


def _convert(tmp_path: Path, name: str, *flags: str) -> None:
    run_dir = tmp_path / "runs" / name
    code = main(["convert", "--model-type-hf", "qwen3-moe", *flags, "--run-dir", str(run_dir)])
    assert code == EXIT_OK, (run_dir / "events.jsonl").read_text()


def test_expert_lora_merges_into_the_trained_model(tmp_path: Path) -> None:
    hf = write_hf_moe_dir(tmp_path / "hf")
    data = write_instruction_data(tmp_path / "data" / "sft", n=16)
    spec = tiny_spec(
        data, load=str(hf), finetune=True, lora_r=4, lora_alpha=8, lr=5e-2, train_iters=3, global_batch_size=4
    )
    spec["save"] = str(tmp_path / "lora")
    for key in TINY_SHAPE:  # the shape comes from the checkpoint
        spec.pop(key, None)
    entry.run(parse_spec(spec), RunDir(tmp_path / "train"))
    rank_file = tmp_path / "lora" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(rank_file, weights_only=False)
    assert "decoder.layers.1.mlp.experts.linear_fc2.lora_B.default.weight" in saved["model"]
    # MindSpeed's merge command lines: HF base + --lora-load, and an mcore base (EP 2, grouped) + --lora-load
    lora = ("--lora-load", str(tmp_path / "lora"), "--lora-r", "4", "--lora-alpha", "8")
    _convert(
        tmp_path,
        "hf",
        *("--load-model-type", "hf", "--save-model-type", "hf", "--load-dir", str(hf)),
        *("--save-dir", str(tmp_path / "merged_hf"), *lora),
    )
    _convert(
        tmp_path,
        "base_mg",
        *("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf)),
        *("--save-dir", str(tmp_path / "mg"), "--target-expert-parallel-size", "2", "--moe-grouped-gemm"),
    )
    _convert(
        tmp_path,
        "mg",
        *("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(tmp_path / "mg")),
        *("--save-dir", str(tmp_path / "merged_mg"), "--hf-cfg-dir", str(hf), *lora),
    )
    a, b = HFCheckpoint(tmp_path / "merged_hf"), HFCheckpoint(tmp_path / "merged_mg")
    names = a.keys()
    assert set(names) == set(b.keys())
    assert all(torch.equal(a.get(k), b.get(k)) for k in names)
    base = HFCheckpoint(hf)
    assert not torch.equal(
        a.get("model.layers.0.mlp.experts.3.down_proj.weight"),
        base.get("model.layers.0.mlp.experts.3.down_proj.weight"),
    )  # the expert adapters trained and were merged
    # the trained model: the base with the saved adapters, unmerged
    cfg = ModelConfig.from_hf(json.loads((hf / "config.json").read_text()))
    trained = Qwen3Model(cfg)
    trained.load_state_dict(base.native_state_dict())
    apply_lora(trained, r=4, alpha=8, targets=saved["args"].lora_target_modules)
    load_lora_state_dict(trained, saved["model"])
    from transformers import Qwen3MoeForCausalLM

    merged = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "merged_hf").eval()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, trained.eval()(ids), rtol=1e-5, atol=1e-5)
