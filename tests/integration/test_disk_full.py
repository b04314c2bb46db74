"""A full disk corrupts nothing: a checkpoint is refused before it starts when its filesystem lacks room for one the
size of the latest, a write that runs out of space mid-save fails the save and removes its partial directory, and in
both cases the previous checkpoint stays the latest and loadable; the job ends ``disk_full`` (retryable).

The data area holding ``save`` is a small tmpfs mounted for the test (skipped where mounting is refused)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from sqlalchemy import select

from core import disk_watch
from core.db import session_scope
from core.models import Event
from core.scheduler import schedule
from core.webhooks import event_type
from core_support import isolated_settings, make_job, team_dir
from engine.checkpoint import dcp
from engine.contract.runfiles import is_disk_full
from sched_support import (
    job_row,
    log_text,
    reconciler,
    resumable_spec,
    running_worker,
    submit,
    tiny_data,
    wait_checkpointed,
    wait_terminal,
)
from worker.hosts import register_host


@contextlib.contextmanager
def small_disk(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` for the block (skips the test where mounting is refused)."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path, leave: int) -> int:
    """Write a file on ``disk`` until ``leave`` bytes are free; returns the bytes free afterwards."""
    chunk = b"\0" * 2**16
    with open(disk / "filler", "ab") as f:
        while (free := shutil.disk_usage(disk).free) > leave:
            f.write(chunk[: min(len(chunk), free - leave)])
            f.flush()
    return shutil.disk_usage(disk).free


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def leftovers(save: Path) -> list[str]:
    return sorted(p.name for p in (save / "train_state").glob("iter_*") if not p.name[5:].isdigit())


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_disk_filling_up_mid_save_leaves_the_previous_checkpoint(
    tmp_path: Path, one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with small_disk(tmp_path / "disk", "4m") as disk:
        dcp.save(disk, 3, model, optimizer, {"consumed_samples": 24})
        one = size_of(disk / "train_state" / "iter_0000003")
        fill(disk, leave=one // 3)
        monkeypatch.setattr(dcp, "no_room", lambda root: "")  # room when checked; another writer took it since
        with pytest.raises(Exception) as raised:
            dcp.save(disk, 6, model, optimizer, {"consumed_samples": 48})
        assert is_disk_full(raised.value), raised.value
        assert dcp.latest(disk) == disk / "train_state" / "iter_0000003" and leftovers(disk) == []
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        assert dcp.load(disk, model, optimizer)["iteration"] == 3
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, saved[k])
        monkeypatch.undo()  # the check itself: no room for one the size of the latest, nothing written
        with pytest.raises(Exception) as refused:
            dcp.save(disk, 6, model, optimizer, {"consumed_samples": 48})
        assert is_disk_full(refused.value) and "refused before it started" in str(refused.value)
        assert dcp.latest(disk).name == "iter_0000003" and leftovers(disk) == []


@pytest.mark.slow
def test_a_training_jobs_disk_fills_up_and_it_ends_disk_full(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, heartbeat_interval_s=1, ingest_interval_s=0.3)
    data = tiny_data(settings)
    with small_disk(team_dir(settings, "t") / "ckpt", "20m") as save:
        spec = resumable_spec(data, save, iters=100000, max_restarts=0, save_interval=10)
        with running_worker(settings, "h1", 2, tmp_path / "h1.log"), reconciler(settings):
            job_id = submit(settings, spec)
            wait_checkpointed(settings, job_id, 240)
            latest = dcp.latest(save)
            assert latest is not None
            fill(save, leave=size_of(latest) // 2)  # while the job trains towards its next save
            row = wait_terminal(settings, job_id, 180)
        assert (row.state, row.error_code) == ("failed", "disk_full"), log_text(settings, job_id)
        assert "disk full" in (row.error_message or "")
        kept = dcp.latest(save)
        assert kept is not None and kept.name >= latest.name and leftovers(save) == []
        meta, weights = dcp.load_model_weights(save)  # the latest loads whole
        assert meta["iteration"] == int(kept.name[5:]) and weights
        assert all(torch.isfinite(t).all() for t in weights.values())
    assert job_row(settings, job_id).attempt_count == 1


def test_watermarks_hold_new_writers_and_tell_running_ones(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "4m") as disk:
        settings = isolated_settings(
            tmp_path / "var",
            data_roots=[tmp_path / "data", disk],
            disk_wait_below_bytes=3 * 2**20,
            disk_warn_below_bytes=2 * 2**20,
        )
        register_host(settings, name="h1", device_type="cpu", devices=2, queues=["q"])
        writes_there = make_job(settings, output_prefix=str(disk / "teams" / "t" / "out"))
        writes_elsewhere = make_job(settings, output_prefix=str(tmp_path / "data" / "teams" / "t" / "out"))
        fill(disk, leave=int(2.5 * 2**20))  # below the high watermark, above the low one
        disk_watch.forget_cache()
        assert [g.job_id for g in schedule(settings)] == [writes_elsewhere]
        held = job_row(settings, writes_there)
        assert held.state == "queued"
        assert (held.pending_reason or "").startswith(f"data root {disk} has ")
        assert "below disk_wait_below_bytes" in (held.pending_reason or "")
        assert disk_watch.warn_running(settings) == 0  # above the low watermark: nobody is told

        (disk / "filler").unlink()  # space freed: the held job starts
        disk_watch.forget_cache()
        assert [g.job_id for g in schedule(settings)] == [writes_there]

        fill(disk, leave=2**20)  # below the low watermark while it runs: told once
        disk_watch.forget_cache()
        assert disk_watch.warn_running(settings) == 1
        assert disk_watch.warn_running(settings) == 0
        with session_scope(settings.database_url) as session:
            [told] = session.scalars(select(Event).where(Event.type == "disk_low")).all()
            assert told.job_id == writes_there and event_type(told) == "job.disk_low"
            assert told.data["root"] == str(disk) and told.data["free_bytes"] < 2 * 2**20
