"""HF <-> Megatron conversion is exact: tensors, files and transformers' logits survive every route."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from convert_tiny import hf_logits, read_hf, tiny_hf
from engine.checkpoint.hf import HFCheckpoint, save_hf
from engine.checkpoint.layout import merge, pipeline_chunks, shard, shard_shape, split_rule
from engine.checkpoint.load import detect_format, load_model_weights
from engine.checkpoint.megatron_read import MegatronCheckpoint
from engine.checkpoint.megatron_write import save_mcore
from engine.model.hf_mapping import native_keys


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf(tmp_path_factory.mktemp("hf") / "model", tied=request.param, dtype=torch.bfloat16)


def _rank_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_hf_to_mcore_tp2_pp2_and_back_is_bit_exact(hf_dir: Path, tmp_path: Path) -> None:
    src = HFCheckpoint(hf_dir)
    save_mcore(src, src.config, tmp_path / "mg", tp=2, pp=2)
    assert _rank_files(tmp_path / "mg") == [
        "iter_0000001/mp_rank_00_000/model_optim_rng.pt",
        "iter_0000001/mp_rank_00_001/model_optim_rng.pt",
        "iter_0000001/mp_rank_01_000/model_optim_rng.pt",
        "iter_0000001/mp_rank_01_001/model_optim_rng.pt",
        "latest_checkpointed_iteration.txt",
    ]
    assert (tmp_path / "mg" / "latest_checkpointed_iteration.txt").read_text() == "1"
    for pt in (tmp_path / "mg").rglob("model_optim_rng.pt"):  # records copied from file ranges carry correct CRCs
        assert zipfile.ZipFile(pt).testzip() is None
    rank = torch.load(tmp_path / "mg/iter_0000001/mp_rank_01_001/model_optim_rng.pt", weights_only=False)
    assert rank["checkpoint_version"] == 3.0 and rank["iteration"] == 1
    a = rank["args"]
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.num_layers, a.num_key_value_heads) == (
        2,
        2,
        4,
        4,
    )
    assert a.group_query_attention and a.qk_layernorm and a.qkv_type == "unpack"
    assert a.untie_embeddings_and_output_weights is not src.config.tie_word_embeddings
    # tied + PP>1: the last stage carries a copy of its embedding shard (docs/megatron-interop.md §2)
    assert "output_layer.weight" in rank["model"]
    assert "embedding.word_embeddings.weight" not in rank["model"]
    # rank files are written in parallel by default; one at a time gives the same tensors
    save_mcore(src, src.config, tmp_path / "serial", tp=2, pp=2, writers=1)
    for pt in (tmp_path / "mg").rglob("model_optim_rng.pt"):
        parallel = torch.load(pt, weights_only=False)["model"]
        serial = torch.load(tmp_path / "serial" / pt.relative_to(tmp_path / "mg"), weights_only=False)["model"]
        assert parallel.keys() == serial.keys() and all(torch.equal(parallel[k], serial[k]) for k in parallel)

    mg = MegatronCheckpoint(tmp_path / "mg")
    assert mg.config == src.config
    assert mg.can_copy(torch.bfloat16)  # same dtype, no LoRA: the byte-copy path is the one under test here
    save_hf(mg, mg.config, tmp_path / "back", max_shard_bytes=150_000)
    original, back = read_hf(hf_dir), read_hf(tmp_path / "back")
    original.pop("lm_head.weight", None) if src.config.tie_word_embeddings else None
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) and original[k].dtype == back[k].dtype for k in original)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "back").glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in back.values())
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(hf_logits(hf_dir, ids), hf_logits(tmp_path / "back", ids))


@pytest.mark.parametrize(
    "layout",
    [
        {"tp": 4, "pp": 1},
        {"tp": 1, "pp": 3, "num_layer_list": [1, 2, 1]},
        {"tp": 2, "pp": 2, "vpp_layers": 1},
    ],
    ids=["tp4", "layer-list", "vpp"],
)
def test_mcore_resharding_keeps_every_tensor(hf_dir: Path, tmp_path: Path, layout: dict) -> None:
    src = HFCheckpoint(hf_dir)
    save_mcore(src, src.config, tmp_path / "a", tp=2, pp=2)
    first = MegatronCheckpoint(tmp_path / "a")
    save_mcore(first, first.config, tmp_path / "b", **layout)  # mg -> mg, no HF in between
    second = MegatronCheckpoint(tmp_path / "b")
    assert (second.tp, second.pp) == (layout["tp"], layout["pp"]) and second.config == src.config
    for key in native_keys(src.config):
        assert torch.equal(second.get_native(key), src.get_native(key)), key
    if "vpp_layers" in layout:
        rank = torch.load(tmp_path / "b/iter_0000001/mp_rank_00_001/model_optim_rng.pt", weights_only=False)
        assert {"model0", "model1"} <= rank.keys() and "model" not in rank


def test_dtype_cast_and_extra_state_tolerated(hf_dir: Path, tmp_path: Path) -> None:
    src = HFCheckpoint(hf_dir)
    save_mcore(src, src.config, tmp_path / "mg", tp=2, pp=1, dtype=torch.float32)
    path = tmp_path / "mg/iter_0000001/mp_rank_00/model_optim_rng.pt"
    assert zipfile.ZipFile(path).testzip() is None  # cast tensors are written through the same CRC'd records
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None  # as Megatron training saves
    state["model"]["output_layer._extra_state"] = None
    torch.save(state, path)
    mg = MegatronCheckpoint(tmp_path / "mg")
    assert mg.get_native("decoder.final_layernorm.weight").dtype == torch.float32
    assert torch.equal(
        mg.get_native("decoder.layers.1.mlp.linear_fc1.weight"),
        src.get_native("decoder.layers.1.mlp.linear_fc1.weight").float(),
    )


def test_shard_rules_are_megatrons() -> None:
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    fc1 = torch.cat([gate, up])
    # rank k holds [gate_k; up_k] (docs/megatron-interop.md §2)
    assert torch.equal(shard(fc1, "glu", 2, 1), torch.cat([gate[2:], up[2:]]))
    assert torch.equal(merge([shard(fc1, "glu", 2, r) for r in range(2)], "glu"), fc1)
    assert split_rule("decoder.layers.3.self_attention.linear_proj.weight") == "dim1"
    assert split_rule("decoder.layers.3.self_attention.linear_qkv.lora_A.weight") == "rep"
    assert split_rule("decoder.layers.3.mlp.linear_fc1.lora_B.default.weight") == "glu"
    assert split_rule("decoder.layers.3.mlp.linear_fc2.lora_A.weight") == "dim1"
    assert split_rule("decoder.layers.3.mlp.linear_fc2.lora_B.weight") == "rep"
    # MoE (expert TP = TP): the router replicated, each expert cut by the dense rule, per expert (stacked dim 0 kept)
    assert split_rule("decoder.layers.3.mlp.router.weight") == "rep"
    assert split_rule("decoder.layers.3.mlp.experts.linear_fc1.weight") == "glu"
    assert split_rule("decoder.layers.3.mlp.experts.linear_fc2.weight") == "dim1"
    assert split_rule("decoder.layers.3.mlp.experts.linear_fc1.lora_A.weight") == "rep"
    assert split_rule("decoder.layers.3.mlp.experts.linear_fc1.lora_B.weight") == "glu"
    assert split_rule("decoder.layers.3.mlp.experts.linear_fc2.lora_A.weight") == "dim1"
    assert split_rule("decoder.layers.3.mlp.experts.linear_fc2.lora_B.weight") == "rep"
    stacked = torch.stack([fc1, fc1 + 1000])  # (E=2, 2F, H)
    assert torch.equal(
        shard(stacked, "glu", 2, 1), torch.stack([shard(fc1, "glu", 2, 1), shard(fc1 + 1000, "glu", 2, 1)])
    )
    assert torch.equal(merge([shard(stacked, "glu", 2, r) for r in range(2)], "glu"), stacked)
    fc2 = torch.arange(24.0).reshape(2, 3, 4)  # (E, H, F): each expert's columns
    assert torch.equal(shard(fc2, "dim1", 2, 0), fc2[:, :, :2])
    assert shard_shape((2, 3, 4), "dim1", 2) == (2, 3, 2) and shard_shape((2, 8, 3), "glu", 2) == (2, 4, 3)
    assert [c[0].layers for c in pipeline_chunks(8, 2, vpp_layers=2)] == [(0, 1), (2, 3)]
    assert [[c.layers for c in s] for s in pipeline_chunks(8, 2, vpp_layers=2)] == [[(0, 1), (4, 5)], [(2, 3), (6, 7)]]
    with pytest.raises(ValueError, match="num_layer_list"):
        pipeline_chunks(9, 2)


def test_detect_format_and_load_model_weights(hf_dir: Path, tmp_path: Path) -> None:
    src = HFCheckpoint(hf_dir)
    save_mcore(src, src.config, tmp_path / "mg", tp=2, pp=2)
    assert detect_format(hf_dir) == "hf" and detect_format(tmp_path / "mg") == "mcore"
    assert detect_format(tmp_path / "mg" / "iter_0000001") == "mcore"
    cfg_hf, from_hf = load_model_weights(hf_dir)
    cfg_mg, from_mg = load_model_weights(tmp_path / "mg")
    assert cfg_hf == cfg_mg and from_hf.keys() == from_mg.keys() == set(native_keys(cfg_hf))
    assert all(torch.equal(from_hf[k], from_mg[k]) for k in from_hf)


def _rewrite(mg: Path, edit) -> None:  # noqa: ANN001 - a small in-test callback
    for pt in sorted(mg.rglob("model_optim_rng.pt")):
        state = torch.load(pt, weights_only=False)
        edit(pt, state)
        torch.save(state, pt)


def test_megatron_padded_vocab_and_missing_args(hf_dir: Path, tmp_path: Path) -> None:
    """A Megatron-trained checkpoint: vocabulary padded to a multiple of 128 × TP, and no ``args`` (the seed's
    "could not find arguments in the checkpoint"). The HF config says what the tensors cannot."""
    src = HFCheckpoint(hf_dir)
    save_mcore(src, src.config, tmp_path / "mg", tp=2, pp=1)
    full = src.get_native("embedding.word_embeddings.weight")
    head = full if src.config.tie_word_embeddings else src.get_native("output_layer.weight")
    zeros = torch.zeros(384 - full.shape[0], full.shape[1], dtype=full.dtype)  # 256 rows padded to 384
    padded = {
        "embedding.word_embeddings.weight": torch.cat([full, zeros]),
        "output_layer.weight": torch.cat([head, zeros]),
    }

    def pad(pt: Path, state: dict) -> None:
        del state["args"]
        for key, value in padded.items():
            if key in state["model"]:  # Megatron pads the full matrix, then splits it: padding sits on the last rank
                state["model"][key] = torch.chunk(value, 2)[int(pt.parent.name[-2:])].clone()

    _rewrite(tmp_path / "mg", pad)
    mg = MegatronCheckpoint(tmp_path / "mg", hf_config=src.hf_config)
    assert mg.args is None and mg.config == src.config  # vocab 256, epsilon and RoPE base from config.json
    assert torch.equal(mg.get_native("embedding.word_embeddings.weight"), full)
    save_hf(mg, mg.config, tmp_path / "hf")
    original, back = read_hf(hf_dir), read_hf(tmp_path / "hf")
    assert all(torch.equal(back[k], original[k]) for k in back)
