"""Finding 1: a checkpoint file must not run code. Each payload's ``__reduce__`` would create a marker file; the
load must refuse the class by name and the marker must not appear. Real Megatron-style files still load."""

from __future__ import annotations

import argparse
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from convert_tiny import tiny_hf
from engine.checkpoint import dcp
from engine.checkpoint.hf import HFCheckpoint
from engine.checkpoint.job import run
from engine.checkpoint.megatron import MODEL_FILE, load_rank_file, save_mcore
from engine.checkpoint.safe_pickle import load_torch_file
from engine.runfiles import BadInput, RunDir
from engine.spec import ConvertSpec


class Payload:
    """Unpickling this would call ``open(marker, "w")``: harmless, but proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


REFUSED = r"refusing to unpickle .*open"


@pytest.fixture(scope="module")
def mg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = tiny_hf(tmp_path_factory.mktemp("hf") / "model", tied=False, layers=2)
    src = HFCheckpoint(hf)
    out = tmp_path_factory.mktemp("mg") / "ckpt"
    save_mcore(src, src.config, out, tp=1, pp=1)
    return out


def _rank_file(root: Path) -> Path:
    return next(root.rglob(MODEL_FILE))


def _poison(mg_dir: Path, tmp_path: Path, zip_format: bool) -> tuple[Path, Path]:
    root = Path(shutil.copytree(mg_dir, tmp_path / "ckpt"))
    marker = tmp_path / "marker"
    rank = _rank_file(root)
    state = load_rank_file(rank)
    state["args"].evil = Payload(marker)
    torch.save(state, rank, _use_new_zipfile_serialization=zip_format)
    return root, marker


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_poisoned_megatron_rank_file_is_refused_by_the_convert_job(
    mg_dir: Path, tmp_path: Path, zip_format: bool
) -> None:
    root, marker = _poison(mg_dir, tmp_path, zip_format)
    spec = ConvertSpec(load_model_type="mg", save_model_type="hf", load_dir=str(root), save_dir=str(tmp_path / "out"))
    with pytest.raises(BadInput, match=REFUSED) as err:
        run(spec, RunDir(tmp_path / "run"))
    assert err.value.field == "load_dir"
    assert not marker.exists()


def test_real_megatron_args_still_load(tmp_path: Path) -> None:
    """What Megatron-LM's save_checkpoint writes: args with dtypes and Megatron-Core's enums, NumPy/torch RNG."""
    enums = pytest.importorskip("megatron.core.transformer.enums")
    core_enums = pytest.importorskip("megatron.core.enums")
    args = argparse.Namespace(
        num_layers=2,
        params_dtype=torch.bfloat16,
        attention_backend=enums.AttnBackend.auto,
        model_type=core_enums.ModelType.encoder_or_decoder,
        data_path=["a", "b"],
    )
    rng = [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {"model-parallel-rng": torch.ones(3)},
        }
    ]
    for zip_format in (True, False):
        path = tmp_path / f"model_optim_rng_{zip_format}.pt"
        torch.save(
            {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": 5,
                "rng_state": rng,
                "model": {"w": torch.arange(4.0)},
            },
            path,
            _use_new_zipfile_serialization=zip_format,
        )
        loaded = load_rank_file(path)
        assert loaded["args"].params_dtype == torch.bfloat16
        assert loaded["args"].attention_backend.value == enums.AttnBackend.auto.value
        assert loaded["args"].data_path == ["a", "b"]
        assert torch.equal(loaded["model"]["w"], torch.arange(4.0))
    assert (
        load_torch_file(tmp_path / "model_optim_rng_False.pt")["rng_state"][0]["np_rng_state"][1]
        == np.random.get_state()[1]
    ).all()


@pytest.fixture
def dcp_checkpoint(tmp_path: Path) -> Path:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        yield dcp.save(tmp_path / "save", 1, model, optimizer, {"x": 1})
    finally:
        dist.destroy_process_group()


def _load(ckpt: Path) -> None:
    model = torch.nn.Linear(4, 4)
    dcp.load(ckpt, model, torch.optim.AdamW(model.parameters()))


def test_dcp_checkpoint_round_trips(dcp_checkpoint: Path) -> None:
    _load(dcp_checkpoint)
    meta, state = dcp.load_model_weights(dcp_checkpoint)
    assert meta["x"] == 1 and set(state) == {"weight", "bias"}


@pytest.mark.parametrize("victim", ["rng_rank0.pt", ".metadata"])
def test_poisoned_dcp_file_is_refused(dcp_checkpoint: Path, tmp_path: Path, victim: str) -> None:
    marker = tmp_path / "marker"
    path = dcp_checkpoint / victim
    if victim.endswith(".pt"):
        torch.save({"python": Payload(marker)}, path)
    else:
        with path.open("wb") as f:
            pickle.dump(Payload(marker), f)
    with pytest.raises(BadInput, match=REFUSED):
        _load(dcp_checkpoint)
    assert not marker.exists()
