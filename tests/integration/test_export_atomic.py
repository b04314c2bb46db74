"""Exports are atomic: an HF export that runs out of space mid-write (a small tmpfs filled beforehand) leaves the
previous export whole and loadable, with no staging directory or half-written shard visible; a Megatron-style export
(iteration directory + tracker, as ``engine.train.export`` stages it) that fails mid-write or while syncing keeps
the tracker naming the previous iteration, and one that succeeds replaces the tracker only after its directory."""

from __future__ import annotations

import errno
import hashlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine.checkpoint import hf  # noqa: E402
from engine.checkpoint.hf import save_hf, staging  # noqa: E402
from engine.checkpoint.load import load_model_weights  # noqa: E402
from engine.contract.model_config import ModelConfig  # noqa: E402
from engine.model.qwen3 import Qwen3Model  # noqa: E402
from test_disk_full import fill, small_disk  # noqa: E402

CFG = ModelConfig(2, 64, 128, 4, 2, 16, vocab_size=512, max_position_embeddings=256)
TRACKER = "latest_checkpointed_iteration.txt"


def weights(seed: int) -> dict[str, torch.Tensor]:
    model = Qwen3Model(CFG)
    model.init_weights(seed)
    return model.state_dict()


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_hf_export_on_a_full_disk_leaves_the_previous_export(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "2m") as disk:
        out = disk / "hf"
        save_hf(weights(1), CFG, out, dtype=torch.float32, max_shard_bytes=2**17)  # several shards
        before = digests(out)
        assert len([n for n in before if n.endswith(".safetensors")]) > 1
        fill(disk, 2**17)  # room for about one shard of the next export, not all of them
        with pytest.raises(OSError) as failed:
            save_hf(weights(2), CFG, out, dtype=torch.float32, max_shard_bytes=2**17)
        assert failed.value.errno == errno.ENOSPC
        assert digests(out) == before  # nothing of the failed export under a final name
        assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
        _, loaded = load_model_weights(out)
        assert all(torch.equal(loaded[k], v) for k, v in weights(1).items())


def stage_iteration(save: Path, iteration: int, fail: bool = False) -> None:
    """What ``engine.train.export`` writes: an iteration directory of rank files and the tracker, staged."""
    with staging(save, name=".staging-export") as tmp:
        rank_dir = tmp / f"iter_{iteration:07d}" / "mp_rank_00"
        rank_dir.mkdir(parents=True)
        (rank_dir / "model_optim_rng.pt").write_bytes(b"x" * 1000)
        if fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        (tmp / TRACKER).write_text(str(iteration))


def test_a_failed_staged_export_keeps_the_tracker_on_the_previous_iteration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = tmp_path / "save"
    stage_iteration(save, 1)
    with pytest.raises(OSError):
        stage_iteration(save, 2, fail=True)  # mid-write
    assert (save / TRACKER).read_text() == "1"
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", TRACKER]

    def full(path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "fsync_tree", full)  # the bytes reached no disk: a delayed-allocation failure
    with pytest.raises(OSError):
        stage_iteration(save, 2)
    assert (save / TRACKER).read_text() == "1"
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", TRACKER]
    monkeypatch.undo()
    stage_iteration(save, 2)
    assert (save / TRACKER).read_text() == "2"
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", "iter_0000002", TRACKER]


def test_publish_keeps_the_old_tracker_until_it_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the renames, a reader sees the old tracker naming the old, whole iteration (never no tracker)."""
    save = tmp_path / "save"
    stage_iteration(save, 1)
    seen: list[str] = []
    replace = hf.os.replace

    def watched(src: Path, dst: Path) -> None:
        seen.append((save / TRACKER).read_text() if (save / TRACKER).exists() else "none")
        replace(src, dst)

    monkeypatch.setattr(hf.os, "replace", watched)
    stage_iteration(save, 2)
    assert seen == ["1", "1"] and (save / TRACKER).read_text() == "2"
