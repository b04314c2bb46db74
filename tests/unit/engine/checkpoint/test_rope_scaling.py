"""YaRN rope scaling: tables and logits equal transformers' ``yarn`` rotary embedding, settings read from and written
to HF configs, Megatron args and spec flags, and the positions a scaled model reaches."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.contract import rope_scaling
from engine.contract.model_config import ModelConfig
from engine.model.rope import inverse_frequencies, rope_cos_sin
from tests.unit.engine.model.test_model_qwen3 import VOCAB, hf_pair

YARN = {
    "rope_scaling_type": "yarn",
    "rope_scaling_factor": 4.0,
    "rope_scaling_original_max_position_embeddings": 64,
}


def yarn_cfg(**extra: object) -> ModelConfig:
    return ModelConfig(
        2, 48, 96, 4, 2, 16, vocab_size=VOCAB, rotary_base=10000.0, max_position_embeddings=80, **{**YARN, **extra}
    )


def hf_config(cfg: ModelConfig) -> Qwen3Config:
    hf = {k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "torch_dtype")}
    return Qwen3Config(**hf)


@pytest.mark.parametrize(
    "extra",
    [{}, {"rope_scaling_mscale": 1.0, "rope_scaling_mscale_all_dim": 0.707}, {"rope_scaling_beta_fast": 8.0}],
)
def test_tables_equal_transformers(extra: dict[str, float]) -> None:
    cfg = yarn_cfg(**extra)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_config(cfg), torch.device("cpu"))
    assert torch.equal(inverse_frequencies(cfg), ref_inv)
    assert rope_scaling.attention_factor(cfg) == pytest.approx(ref_scale, rel=1e-12)


def test_plain_rope_tables_unchanged() -> None:
    cfg = yarn_cfg().replace(rope_scaling_type=None)
    cos, _ = rope_cos_sin(torch.arange(4)[None], cfg, torch.float32)
    assert cos[0, 0].eq(1).all()  # position 0 and no attention factor


def test_logits_equal_transformers_past_the_original_length() -> None:
    hf, ours = hf_pair(yarn_cfg())
    ids = torch.randint(0, VOCAB, (1, 200))  # beyond both the original 64 and max_position_embeddings 80
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff <= 1e-5, diff


def test_hf_config_round_trip_and_published_form() -> None:
    cfg = yarn_cfg()
    assert cfg.to_hf()["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    # transformers 5 writes rope_parameters (theta inside); Qwen3's model cards write rope_scaling with "type"
    new_style = {**cfg.to_hf(), "rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4,
                 "factor": 4.0, "original_max_position_embeddings": 64}}  # fmt: skip
    assert ModelConfig.from_hf(new_style) == cfg
    old_style = {**cfg.to_hf(), "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    assert ModelConfig.from_hf(old_style) == cfg
    plain = {**cfg.to_hf(), "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert ModelConfig.from_hf(plain).rope_scaling_type is None


def test_positions_reached() -> None:
    assert yarn_cfg().max_positions == 256  # 64 × 4 > 80
    assert yarn_cfg().replace(rope_scaling_type=None).max_positions == 80


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rope_scaling_type": "longrope"}, "rope_scaling_type"),
        ({"rope_scaling_original_max_position_embeddings": None}, "rope_scaling_original_max_position_embeddings"),
        ({"rope_scaling_factor": 0.5}, "rope_scaling_factor"),
    ],
)
def test_bad_settings_name_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        yarn_cfg(**change)


def test_unsupported_hf_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        ModelConfig.from_hf({**yarn_cfg().to_hf(), "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_megatron_args_carry_it() -> None:
    args = argparse.Namespace(**YARN, rope_scaling_beta_fast=32.0, num_layers=2)
    assert rope_scaling.from_args(args) == {**YARN, "rope_scaling_beta_fast": 32.0}
    assert rope_scaling.from_args(argparse.Namespace(num_layers=2)) == {}


def test_conversion_carries_yarn_both_ways(tmp_path: Path) -> None:
    from convert_tiny import hf_logits, tiny_hf
    from engine.checkpoint.hf import HFCheckpoint, save_hf
    from engine.checkpoint.megatron_read import MegatronCheckpoint
    from engine.checkpoint.megatron_write import save_mcore

    hf_dir = tiny_hf(tmp_path / "hf", tied=False, layers=2)
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    (hf_dir / "config.json").write_text(json.dumps(config))
    src = HFCheckpoint(hf_dir)
    assert src.config.rope_scaling_type == "yarn" and src.config.max_positions == 256
    save_mcore(src, src.config, tmp_path / "mg", tp=2, pp=1)
    mg = MegatronCheckpoint(tmp_path / "mg")
    assert mg.config == src.config  # the args carry MindSpeed's --rope-scaling-* values
    save_hf(mg, mg.config, tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["rope_scaling"]["rope_type"] == "yarn" and back["rope_scaling"]["factor"] == 4.0
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))  # past 64 and 80
    assert torch.equal(hf_logits(hf_dir, ids), hf_logits(tmp_path / "back", ids))
