"""Bad checkpoints fail with BadInput naming the file and tensor, and never leave half-written output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from convert_tiny import tiny_hf
from engine.checkpoint.hf import HFCheckpoint, save_hf
from engine.checkpoint.job import run
from engine.checkpoint.megatron_read import MegatronCheckpoint
from engine.checkpoint.megatron_write import save_mcore
from engine.contract.runfiles import BadInput, RunDir
from engine.contract.spec import ConvertSpec


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf(tmp_path_factory.mktemp("hf") / "model", tied=False, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def mg_dir(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = HFCheckpoint(hf_dir)
    out = tmp_path_factory.mktemp("mg") / "ckpt"
    save_mcore(src, src.config, out, tp=2, pp=2)
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


def _convert(tmp_path: Path, **fields: object) -> tuple[dict, dict]:
    spec = ConvertSpec(**{"load_model_type": "hf", "save_model_type": "mg", **fields})
    return run(spec, RunDir(tmp_path / "run"))


def test_missing_shard_file(hf_dir: Path, tmp_path: Path) -> None:
    bad = _copy(hf_dir, tmp_path)
    victim = sorted(bad.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(BadInput, match=victim.name):
        HFCheckpoint(bad)


def test_truncated_safetensors_names_the_file(hf_dir: Path, tmp_path: Path) -> None:
    bad = _copy(hf_dir, tmp_path)
    victim = min(bad.glob("model-*.safetensors"))
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(BadInput, match=f"{victim.name}.*truncated"):
        HFCheckpoint(bad)


def test_shape_that_does_not_match_the_config(hf_dir: Path, tmp_path: Path) -> None:
    bad = _copy(hf_dir, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match=r"model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight has shape"):
        HFCheckpoint(bad)


def test_tp_must_divide_kv_groups_and_nothing_is_written(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="4 KV heads \\(num_query_groups\\)") as err:
        _convert(tmp_path, load_dir=str(hf_dir), save_dir=str(tmp_path / "out"), target_tensor_parallel_size=8)
    assert err.value.field == "target_tensor_parallel_size"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_layer_list_must_cover_the_layers(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="num_layer_list"):
        _convert(
            tmp_path,
            load_dir=str(hf_dir),
            save_dir=str(tmp_path / "out"),
            target_pipeline_parallel_size=2,
            num_layer_list="1,2",
        )


def test_release_tracker_where_an_iteration_is_needed(mg_dir: Path, tmp_path: Path) -> None:
    bad = _copy(mg_dir, tmp_path)
    (bad / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(BadInput, match="says 'release' but the checkpoint has iter_0000001; an iteration number"):
        MegatronCheckpoint(bad)


def test_missing_rank_and_truncated_rank_file(mg_dir: Path, tmp_path: Path) -> None:
    bad = _copy(mg_dir, tmp_path)
    shutil.rmtree(bad / "iter_0000001" / "mp_rank_01_000")
    with pytest.raises(BadInput, match="mp_rank_01_000: missing"):
        MegatronCheckpoint(bad)
    bad2 = _copy(mg_dir, tmp_path / "2")
    pt = bad2 / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt"
    pt.write_bytes(pt.read_bytes()[:2000])
    with pytest.raises(BadInput, match="mp_rank_00_001/model_optim_rng.pt: not a readable"):
        MegatronCheckpoint(bad2)


def test_wrong_tensor_shape_in_a_rank_file(mg_dir: Path, tmp_path: Path) -> None:
    bad = _copy(mg_dir, tmp_path)
    pt = bad / "iter_0000001" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(pt, weights_only=False)
    state["model"]["decoder.layers.1.mlp.linear_fc2.weight"] = torch.zeros(64, 7, dtype=torch.bfloat16)
    torch.save(state, pt)
    with pytest.raises(
        BadInput, match=r"mp_rank_01_001/model_optim_rng.pt: tensor decoder\.layers\.1\.mlp\.linear_fc2"
    ):
        MegatronCheckpoint(bad)


def test_failed_write_leaves_no_complete_looking_output(hf_dir: Path, tmp_path: Path) -> None:
    src = HFCheckpoint(hf_dir)
    calls = []

    def flaky(key: str) -> torch.Tensor:
        calls.append(key)
        if len(calls) > 20:
            raise OSError("disk full")
        return src.get_native(key)

    with pytest.raises(OSError):
        save_hf(flaky, src.config, tmp_path / "hf", max_shard_bytes=100_000)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == []
    calls.clear()
    with pytest.raises(OSError):
        save_mcore(flaky, src.config, tmp_path / "mg", tp=1, pp=2)
    assert sorted(p.name for p in (tmp_path / "mg").iterdir()) == []


def test_wrong_load_model_type(hf_dir: Path, mg_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="load_model_type is mg but this is an HF model"):
        _convert(tmp_path, load_model_type="mg", load_dir=str(hf_dir), save_dir=str(tmp_path / "o"))
    with pytest.raises(BadInput, match="load_model_type is hf but this is a mcore"):
        _convert(tmp_path, load_dir=str(mg_dir), save_dir=str(tmp_path / "o"))
    with pytest.raises(BadInput, match="neither an HF model"):
        _convert(tmp_path, load_dir=str(tmp_path), save_dir=str(tmp_path / "o"))
