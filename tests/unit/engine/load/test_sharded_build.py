"""Seeded initial weights served one TP piece at a time equal ``init_weights`` / ``apply_lora`` on the full model,
and one process's meta-built, filled model equals the full build (init, HF, mcore; tied and untied; LoRA; MoE
router and stacked experts, LoRA on the experts included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.checkpoint import sources
from engine.checkpoint.hf import HFCheckpoint, save_hf
from engine.checkpoint.layout import shard, split_rule
from engine.checkpoint.megatron_write import save_mcore
from engine.checkpoint.sharded import _read_in_place, fill_parameter
from engine.checkpoint.sources import SeededInit, SeededLoraInit
from engine.contract.model_config import ModelConfig
from engine.contract.spec import TrainSpec
from engine.load.rank_model import build_rank_model
from engine.load.weights import open_load
from engine.model.lora import apply_lora
from engine.model.qwen3 import Qwen3Model
from engine.parallel.device import Device
from engine.parallel.mesh import ParallelDims, build_mesh
from engine.parallel.parallelize import parallelize


def _cfg(tied: bool, moe: bool = False) -> ModelConfig:
    # odd sizes on purpose: rows * cols not a multiple of 16, chunks that end mid-way; MoE: layer 1 dense
    experts = {"num_experts": 5, "moe_router_topk": 2, "moe_ffn_hidden_size": 10, "moe_layer_freq": (1, 0, 1)}
    return ModelConfig(
        num_layers=3,
        hidden_size=24,
        ffn_hidden_size=40,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=6,
        vocab_size=68,
        tie_word_embeddings=tied,
        **(experts if moe else {}),
    )


@pytest.mark.parametrize("chunk", [1 << 22, 64, 48])
@pytest.mark.parametrize("tied,moe", [(True, False), (False, False), (False, True)])
def test_seeded_pieces_equal_the_full_init(tied: bool, moe: bool, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "_CHUNK_ELEMS", chunk)
    cfg = _cfg(tied, moe)
    model = Qwen3Model(cfg)
    model.init_weights(3)
    modules = apply_lora(model, 4, 8.0, seed=5)
    full = model.state_dict()
    for tp in (1, 2):
        base, lora = SeededInit(cfg, 3), SeededLoraInit(cfg, modules, 4, 5)
        for rank in range(tp):
            for key, value in full.items():
                got = (lora if ".lora_" in key else base).get_native_shard(key, tp, rank)
                assert torch.equal(got, shard(value, split_rule(key), tp, rank)), (key, tp, rank)
    assert not torch.equal(
        SeededInit(cfg, 4).get_native(modules[0] + ".weight"), full[modules[0] + ".weight"]
    )  # another seed, other numbers


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _spec(lora: bool) -> TrainSpec:
    extra = {"lora_r": 4, "lora_alpha": 8.0} if lora else {}
    return TrainSpec.model_validate(
        {
            "kind": "train",
            "data_path": ["unused"],
            "train_iters": 1,
            "lr": 1e-3,
            "seq_length": 16,
            "micro_batch_size": 1,
            "seed": 9,
            **extra,
        }
    )


@pytest.mark.parametrize("src", ["init", "hf", "mcore"])
@pytest.mark.parametrize(
    "tied,lora,moe", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)]
)
def test_one_process_build_equals_full_build(
    one_rank_group: None, tmp_path: Path, src: str, tied: bool, lora: bool, moe: bool
) -> None:
    cfg, spec = _cfg(tied, moe), _spec(lora)
    mesh = build_mesh(Device("cpu"), ParallelDims())
    old = Qwen3Model(cfg)
    if src == "init":
        old.init_weights(spec.seed)
        base = SeededInit(cfg, spec.seed)
    else:
        written = Qwen3Model(cfg)
        written.init_weights(1)
        (save_hf if src == "hf" else save_mcore)(written.state_dict(), cfg, tmp_path / src)
        base = open_load(str(tmp_path / src)).source
        assert isinstance(base, sources.WeightSource)
        old.load_state_dict({k: base.get_native(k).float() for k in old.state_dict()})
    if lora:
        apply_lora(old, 4, 8.0, seed=spec.seed)
    old = parallelize(old, mesh, spec)
    new = build_rank_model(cfg, mesh, spec, 1, 16, torch.device("cpu"), base)
    new_params, old_params = dict(new.named_parameters()), dict(old.named_parameters())
    assert new_params.keys() == old_params.keys()
    for name, p in new_params.items():
        assert p.device.type == "cpu" and torch.equal(p, old_params[name]), name
        assert p.requires_grad == old_params[name].requires_grad, name


@pytest.mark.parametrize("moe", [False, True])
def test_hf_pieces_come_from_the_one_key_map(tmp_path: Path, moe: bool) -> None:
    """The HF reader's TP pieces (row runs derived from the key map; per expert for stacked experts) equal the full
    native tensor cut by TP; an MoE checkpoint written with TP 2 reads back whole and by piece."""
    cfg = _cfg(False, moe).replace(num_query_groups=2, vocab_size=68)
    model = Qwen3Model(cfg)
    model.init_weights(2)
    save_hf(model.state_dict(), cfg, tmp_path / "hf")
    ckpt = HFCheckpoint(tmp_path / "hf")
    for key, value in model.state_dict().items():
        for rank in range(2):
            assert torch.equal(ckpt.get_native_shard(key, 2, rank), shard(value, split_rule(key), 2, rank)), key
    if not moe:
        return
    save_mcore(ckpt, cfg, tmp_path / "mcore", tp=2)
    mcore = open_load(str(tmp_path / "mcore")).source
    assert mcore is not None
    for key, value in model.state_dict().items():
        assert torch.equal(mcore.get_native(key), value), key
        assert torch.equal(mcore.get_native_shard(key, 2, 1), shard(value, split_rule(key), 2, 1)), key


def test_hf_pieces_read_straight_into_the_parameter(tmp_path: Path) -> None:
    """A piece stored as it is wanted (same dtype, all of the local rows) is read into the parameter itself, with no
    tensor-sized temporary; one needing a cast falls back to reading then copying, with the same values."""
    cfg = _cfg(False).replace(num_query_groups=2, vocab_size=68)
    model = Qwen3Model(cfg)
    model.init_weights(2)
    save_hf(model.state_dict(), cfg, tmp_path / "hf")
    ckpt = HFCheckpoint(tmp_path / "hf")
    for key, value in model.state_dict().items():
        for rank in range(2):
            want = shard(value, split_rule(key), 2, rank)
            if split_rule(key) == "dim1":  # a column slice is no plain byte range
                continue
            got = torch.empty_like(want)
            assert _read_in_place(got, key, ckpt, 2, rank), key
            assert torch.equal(got, want), key
        low = torch.empty_like(value, dtype=torch.bfloat16)
        assert not _read_in_place(low, key, ckpt, 1, 0)
        fill_parameter(low, key, ckpt)
        assert torch.equal(low, value.to(torch.bfloat16)), key
