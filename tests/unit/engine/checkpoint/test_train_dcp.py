"""Training checkpoints: a crash in the middle of a save leaves the previous checkpoint the loadable latest one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.checkpoint import dcp


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_interrupted_save_keeps_previous_checkpoint(tmp_path: Path, one_rank_group: None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    dcp.save(tmp_path, 3, model, optimizer, {"consumed_samples": 24})

    # A later save dies after writing some shards: its directory is still *.tmp and the tracker was not touched.
    broken = tmp_path / "train_state" / "iter_0000006.tmp"
    broken.mkdir()
    (broken / "__0_0.distcp").write_bytes(b"half a shard")
    assert dcp.latest(tmp_path) == tmp_path / "train_state" / "iter_0000003"

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    meta = dcp.load(tmp_path, model, optimizer)
    assert meta["iteration"] == 3 and meta["consumed_samples"] == 24
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, saved[k])
    assert optimizer.state_dict()["state"][0]["step"] == 1

    dcp.save(tmp_path, 6, model, optimizer, {"consumed_samples": 48})  # the next save clears the leftover
    assert not broken.exists() and dcp.latest(tmp_path).name == "iter_0000006"
    assert dcp.is_training_checkpoint(tmp_path / "train_state")
