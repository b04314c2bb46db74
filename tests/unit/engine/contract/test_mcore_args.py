"""``args`` in our mcore files (issue 17 item 8): ``seq_length`` is the training length (or MindSpeed's converter
value 4096 from ``configs/checkpoint/model_cfg.json``, never ``max_position_embeddings``), and the source
config.json's plain attributes are carried as they are (MindSpeed v2 ``convert_hf2mg.py::__parameter_packaging``)."""

from __future__ import annotations

import json

import torch

from convert_tiny import tiny_hf
from engine.checkpoint.job import run
from engine.checkpoint.megatron_write import build_args
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import RunDir
from engine.contract.spec import ConvertSpec


def test_converted_checkpoint_carries_the_source_config_and_mindspeeds_seq_length(tmp_path):
    hf = tiny_hf(tmp_path / "hf", tied=True, layers=2)
    config = json.loads((hf / "config.json").read_text())
    config["rope_theta"] = 123456.0  # fields the tensors cannot tell, as the source says them
    config["custom_marker"] = "from-source"
    (hf / "config.json").write_text(json.dumps(config))
    spec = ConvertSpec(load_model_type="hf", save_model_type="mg", load_dir=str(hf), save_dir=str(tmp_path / "mg"))
    run(spec, RunDir(tmp_path / "run"))
    args = torch.load(tmp_path / "mg" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)[
        "args"
    ]
    assert config["max_position_embeddings"] == 256 and args.seq_length == 4096
    assert args.custom_marker == "from-source" and args.rope_theta == 123456.0 and args.rotary_base == 123456.0
    for key in (
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "tie_word_embeddings",
        "architectures",
    ):
        assert getattr(args, key) == config[key], key


def test_trainer_length_is_written_when_known():
    cfg = ModelConfig.from_hf(
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "tie_word_embeddings": True,
        }
    )
    assert build_args(cfg, 1, 1, torch.bfloat16, seq_length=2048).seq_length == 2048
    assert build_args(cfg, 1, 1, torch.bfloat16).seq_length == 4096
    assert build_args(cfg, 1, 1, torch.bfloat16).max_position_embeddings == 40960
