"""Checkpoints our trainer saved convert to HF, and transformers then gives the logits our engine gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from convert_tiny import hf_logits, read_hf
from engine.checkpoint import dcp
from engine.checkpoint.hf import HFCheckpoint, save_hf
from engine.checkpoint.job import run as convert
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import RunDir
from engine.contract.spec import ConvertSpec, parse_spec
from engine.model.lora import apply_lora, load_lora_state_dict
from engine.model.qwen3 import Qwen3Model
from engine.train import entry as train
from train_support import TINY_SHAPE, tiny_spec, write_instruction_data

IDS = torch.randint(1, 512, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_instruction_data(tmp_path_factory.mktemp("data") / "sft")


def _engine_logits(model: Qwen3Model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).float()


def _convert(tmp_path: Path, name: str, **fields: object) -> Path:
    out = tmp_path / name
    convert(ConvertSpec(save_model_type="hf", save_dir=str(out), **fields), RunDir(tmp_path / f"run-{name}"))
    return out


def test_full_finetune_checkpoint(data: str, tmp_path: Path) -> None:
    save = tmp_path / "save"
    train.run(parse_spec(tiny_spec(data, train_iters=2, save_interval=2, save=str(save))), RunDir(tmp_path / "train"))
    # The engine's own view of the trained weights: the trainer's DCP state, read by the trainer's loader.
    meta, state = dcp.load_model_weights(save)
    cfg = ModelConfig(**meta["model_config"])
    model = Qwen3Model(cfg)
    model.load_state_dict(state)
    expected = _engine_logits(model)

    from_mcore = _convert(tmp_path, "hf-from-mcore", load_model_type="mg", load_dir=str(save))
    torch.testing.assert_close(hf_logits(from_mcore, IDS), expected, rtol=1e-5, atol=1e-5)
    from_dcp = _convert(tmp_path, "hf-from-dcp", load_model_type="mg", load_dir=str(save / "train_state"))
    a, b = read_hf(from_mcore), read_hf(from_dcp)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_adapters_on_an_hf_base(data: str, tmp_path: Path) -> None:
    cfg = ModelConfig(2, 64, 128, 4, 2, 16, vocab_size=512, max_position_embeddings=256)
    base = Qwen3Model(cfg)
    base.init_weights(1)
    hf_base = tmp_path / "base"
    save_hf(base.state_dict(), cfg, hf_base, dtype=torch.float32)
    save = tmp_path / "save"
    shape = {k: v for k, v in TINY_SHAPE.items() if k != "ffn_hidden_size"}
    spec = tiny_spec(
        data,
        **shape,
        load=str(hf_base),
        finetune=True,
        lora_r=4,
        lora_alpha=8,
        lr=5e-2,
        lora_target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        train_iters=2,
        save_interval=2,
        save=str(save),
    )
    train.run(parse_spec(spec), RunDir(tmp_path / "train"))

    model = Qwen3Model(cfg)
    model.load_state_dict(HFCheckpoint(hf_base).native_state_dict())
    apply_lora(model, r=4, alpha=8, targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    load_lora_state_dict(model, dcp.load_model_weights(save)[1])
    expected = _engine_logits(model)  # unmerged: W x + alpha/r · B (A x)
    assert not torch.allclose(expected, _engine_logits(base), atol=1e-4)  # the adapters did learn something

    merged = _convert(tmp_path, "merged", load_model_type="hf", load_dir=str(hf_base), lora_load=str(save))
    torch.testing.assert_close(hf_logits(merged, IDS), expected, rtol=1e-4, atol=1e-4)
