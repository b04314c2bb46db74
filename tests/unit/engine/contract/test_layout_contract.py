"""The layout rule exists once (``engine.contract.layout``): admission and the engine refuse the same layouts with
the same field and message, and ParallelDims maps ranks to coordinates as the mesh lays them out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.admission import check_admissible
from core.errors import ApiError
from core_support import isolated_settings
from engine.contract import layout
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput
from engine.contract.spec import TrainSpec, parse_spec
from engine.parallel.pipeline_parallel import check_parallel_layout

# a tiny Qwen3 as an HF config.json: 4 heads, 2 KV heads, 4 layers, FFN 96, vocabulary 256
BASE = {
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1}

CASES = [  # (config changes, layout flags, field, message)
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, {"tensor_model_parallel_size": 4},
     "tensor_model_parallel_size", "TP 4 does not divide the model's 6 heads (num_attention_heads)"),
    ({}, {"tensor_model_parallel_size": 4},
     "tensor_model_parallel_size", "TP 4 does not divide the model's 2 KV heads (num_query_groups); each rank must hold whole groups"),
    ({"num_key_value_heads": 4, "intermediate_size": 90}, {"tensor_model_parallel_size": 4},
     "tensor_model_parallel_size", "TP 4 does not divide the model's 90 FFN width (ffn_hidden_size)"),
    ({"num_key_value_heads": 4, "vocab_size": 258}, {"tensor_model_parallel_size": 4},
     "tensor_model_parallel_size", "TP 4 does not divide the model's 258 vocabulary rows (padded_vocab_size)"),
    ({"num_hidden_layers": 3}, {"pipeline_model_parallel_size": 2},
     "pipeline_model_parallel_size", "PP 2 does not divide the model's 3 layers; give num_layer_list"),
    ({}, {"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 3},
     "num_layers_per_virtual_pipeline_stage", "PP 2 × 3 layers per virtual stage does not divide the model's 4 layers"),
    ({}, {"expert_model_parallel_size": 2},
     "expert_model_parallel_size", "EP 2 needs an MoE model (num_experts); the model is dense"),
    (MOE, {"expert_model_parallel_size": 8, "resources": {"nproc_per_node": 8}},
     "expert_model_parallel_size", "EP 8 does not divide the model's 4 experts (num_experts)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 6}, {"context_parallel_size": 4, "resources": {"nproc_per_node": 4}},
     "context_parallel_size", "TP 1 × CP 4 does not divide the model's 6 heads (Ulysses)"),
]  # fmt: skip


def _body(tmp_path: Path, config: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    for suffix in (".bin", ".idx"):
        (tmp_path / f"ds_text_document{suffix}").write_bytes(b"")
    degree = max(flags.get(k, 1) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size"))
    ep = flags.get("expert_model_parallel_size", 1)
    resources = flags.get("resources", {"nproc_per_node": degree * ep})
    return {
        "kind": "train",
        "data_path": str(tmp_path / "ds"),
        "load": str(tmp_path / "hf"),
        "train_iters": 10,
        "lr": 1e-4,
        "seq_length": 64,
        **flags,
        "resources": resources,
    }


@pytest.mark.parametrize(("changes", "flags", "field", "message"), CASES)
def test_admission_and_engine_refuse_alike(
    tmp_path: Path, changes: dict[str, Any], flags: dict[str, Any], field: str, message: str
) -> None:
    config = {**BASE, **changes}
    spec = parse_spec(_body(tmp_path, config, flags))
    assert isinstance(spec, TrainSpec)
    with pytest.raises(ApiError) as refused:
        check_admissible(spec, isolated_settings(tmp_path), "alpha")
    dims = spec.parallel_dims
    with pytest.raises(BadInput) as engine:
        check_parallel_layout(spec, ModelConfig.from_hf(config), dims, dims.dp * spec.micro_batch_size * 8)
    assert (refused.value.field, refused.value.message) == (engine.value.field, str(engine.value))
    assert refused.value.message == f"{field}: {message}"


def test_world_divisibility_is_named_once() -> None:
    with pytest.raises(layout.LayoutError, match=r"^tensor_model_parallel_size: TP \(2\) × PP \(2\) must divide"):
        layout.ParallelDims.from_world(6, tp=2, pp=2)
    with pytest.raises(layout.LayoutError, match=r"^expert_model_parallel_size: EP 4 must divide the data-parallel"):
        layout.ParallelDims.from_world(8, tp=4, ep=4)


def test_rank_coordinates_follow_the_mesh_order() -> None:
    dims = layout.ParallelDims.from_world(8, tp=2, pp=2, ep=2)
    assert (dims.dp, dims.pp, dims.tp, dims.ep, dims.cp) == (2, 2, 2, 2, 1)
    assert dims.coords(0) == (0, 0, 0, 0, 0)
    assert dims.coords(1) == (0, 0, 1, 0, 0)  # TP varies fastest
    assert dims.coords(2) == (0, 1, 0, 0, 0)
    assert dims.coords(7) == (1, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="outside a world of 8"):
        dims.coords(8)


def test_megatron_load_is_checked_at_submission(tmp_path: Path) -> None:
    """A Megatron ``load``'s shape (read from its ``args`` without torch) meets the same rule as an HF one."""
    from engine.checkpoint.megatron_write import save_mcore
    from engine.model.qwen3 import Qwen3Model

    cfg = ModelConfig.from_hf({**BASE, "num_hidden_layers": 3})
    save_mcore(Qwen3Model(cfg).state_dict(), cfg, tmp_path / "mg", tp=1, pp=1)
    body = {**_body(tmp_path, BASE, {"pipeline_model_parallel_size": 2}), "load": str(tmp_path / "mg")}
    with pytest.raises(ApiError) as refused:
        check_admissible(parse_spec(body), isolated_settings(tmp_path), "alpha")
    assert refused.value.field == "pipeline_model_parallel_size"
    assert refused.value.message.endswith("PP 2 does not divide the model's 3 layers; give num_layer_list")
