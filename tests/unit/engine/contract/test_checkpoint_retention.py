"""Checkpoint retention (keep_last_n, keep_best_by): the pure rule, the spec's checks (422 naming the field at
submission), pruning on disk that survives a crash mid-delete, and a tiny training run that keeps the last two."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parents[2]))
from core_support import auth, isolated_settings, make_token  # noqa: E402
from engine.checkpoint import dcp  # noqa: E402
from engine.contract.retention import metric_name, to_delete  # noqa: E402
from engine.contract.spec import parse_spec  # noqa: E402


def test_keep_last_n_deletes_the_older_ones_only() -> None:
    saved = {i: None for i in (1, 2, 3, 4, 5)}
    assert to_delete(saved, 5, 2) == [1, 2, 3]
    assert to_delete(saved, 5, 1) == [1, 2, 3, 4]
    assert to_delete(saved, 5, 10) == []
    assert to_delete(saved, 5, None) == []  # unset: keep everything
    assert to_delete(saved, 3, 1) == [1, 2]  # newer ones (4, 5: not this timeline's) are never touched
    assert to_delete({7: None}, 7, 1) == []  # the one just written always stays
    with pytest.raises(ValueError):
        to_delete(saved, 5, 0)


def test_keep_best_by_keeps_the_lowest_in_addition() -> None:
    saved = {1: 3.0, 2: 1.0, 3: 2.0, 4: float("nan"), 5: 2.5}
    assert to_delete(saved, 5, 2, keep_best=True) == [1, 3]
    assert to_delete(saved, 5, 2, keep_best=False) == [1, 2, 3]
    assert to_delete({1: 1.0, 2: 1.0, 3: 5.0}, 3, 1, keep_best=True) == [1]  # a tie keeps the newer
    assert to_delete({1: None, 2: None, 3: None}, 3, 1, keep_best=True) == [1, 2]  # nothing measured: last n only
    assert to_delete({1: 9.0, 2: 0.5, 3: 1.0}, 2, 1, keep_best=True) == [1]  # the best newer than the save stays too


def test_metric_spellings() -> None:
    assert [metric_name(v) for v in ("lm loss", "LM-Loss", "loss", "val_loss", "val lm loss", "validation loss")] == [
        "lm_loss",
        "lm_loss",
        "lm_loss",
        "val_lm_loss",
        "val_lm_loss",
        "val_lm_loss",
    ]


BASE: dict[str, Any] = {"kind": "train", "data_path": "ds", "train_iters": 10, "lr": 1e-4, "seq_length": 64}


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"keep_last_n": 0, "save_interval": 1}, "keep_last_n", "greater than or equal to 1"),
        ({"keep_last_n": 2}, "keep_last_n", "set save_interval"),
        ({"keep_best_by": "lm_loss", "save_interval": 1}, "keep_best_by", "needs keep_last_n"),
        ({"keep_best_by": "accuracy", "keep_last_n": 1, "save_interval": 1}, "keep_best_by", "lm_loss"),
        (
            {"keep_best_by": "val_loss", "keep_last_n": 1, "save_interval": 5, "eval_interval": 2},
            "keep_best_by",
            "multiple",
        ),
        (
            {"keep_best_by": "val_loss", "keep_last_n": 1, "save_interval": 4, "eval_interval": 2, "eval_iters": 0},
            "keep_best_by",
            "eval_iters",
        ),
    ],
)
def test_bad_retention_is_a_422_naming_the_field(tmp_path: Path, extra: dict[str, Any], field: str, words: str) -> None:
    from app.main import create_app

    settings = isolated_settings(tmp_path)
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as api:
        answer = api.post("/v1/jobs", json={**BASE, **extra})
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == field and words in answer.json()["message"], answer.json()


def test_the_spec_takes_mindspeed_spellings() -> None:
    spec = parse_spec({**BASE, "keep_last_n": 2, "save_interval": 10, "eval_interval": 5, "keep_best_by": "val loss"})
    assert spec.keep_last_n == 2 and spec.keep_best_by == "val_lm_loss"  # type: ignore[union-attr]


def _fake_checkpoint(save: Path, iteration: int, **metrics: float) -> Path:
    path = dcp.state_root(save) / dcp.iter_name(iteration)
    path.mkdir(parents=True)
    (path / dcp.META).write_text(json.dumps({"iteration": iteration, "metrics": metrics}))
    return path


def test_prune_on_disk_leaves_unfinished_and_doomed_dirs_out(tmp_path: Path) -> None:
    for iteration, loss in ((10, 2.0), (20, 1.0), (30, 1.5), (40, 1.8)):
        _fake_checkpoint(tmp_path, iteration, val_lm_loss=loss)
    root = dcp.state_root(tmp_path)
    (root / "iter_0000050.tmp").mkdir()  # being written
    (root / ("iter_0000005" + dcp.TRASH)).mkdir()  # a crash mid-delete earlier
    (root / dcp.TRACKER).write_text("40")
    assert sorted(dcp.complete_checkpoints(tmp_path)) == [10, 20, 30, 40]
    assert dcp.prune(tmp_path, 40, 1, "val_lm_loss") == [10, 30]
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000005.trash",
        "iter_0000020",
        "iter_0000040",
        "iter_0000050.tmp",
        dcp.TRACKER,
    ]
    assert dcp.prune(tmp_path, 40, 1) == [20]
    assert dcp.latest(tmp_path) == root / "iter_0000040"


def test_training_keeps_the_last_two(tmp_path: Path) -> None:
    from engine.contract.runfiles import RunDir
    from engine.train import entry
    from train_support import tiny_spec, write_instruction_data

    data = write_instruction_data(tmp_path / "data" / "sft", n=16)
    spec = tiny_spec(
        data,
        train_iters=3,
        save_interval=1,
        keep_last_n=2,
        keep_best_by="lm loss",
        save=str(tmp_path / "save"),
        eval_iters=0,
    )
    entry.run(parse_spec(spec), RunDir(tmp_path / "run"))
    root = dcp.state_root(tmp_path / "save")
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "iter_0000003", dcp.TRACKER]
    meta = json.loads((root / "iter_0000003" / dcp.META).read_text())
    assert meta["metrics"]["lm_loss"] > 0 and (root / dcp.TRACKER).read_text() == "3"
    assert (tmp_path / "save" / "iter_0000003").is_dir()  # the final export stays
