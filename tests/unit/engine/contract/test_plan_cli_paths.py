"""``python -m engine plan --spec`` resolves relative paths as the API does: from the team's area (``--data-root``,
or the first of the areas a worker hands the engine), not from the current directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.contract.guard import WRITE_ENV
from engine.contract.model_config import preset
from engine.contract.plan.cli import main


@pytest.fixture
def spec_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    area = tmp_path / "teams" / "default"
    (area / "models" / "tiny").mkdir(parents=True)
    (area / "models" / "tiny" / "config.json").write_text(json.dumps(preset("qwen3-tiny").to_hf()))
    spec = {"kind": "train", "load": "models/tiny", "seq_length": 64, "data_path": ["d"], "train_iters": 1, "lr": 0.1}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    monkeypatch.chdir(tmp_path)  # the relative load does not exist here
    monkeypatch.delenv(WRITE_ENV, raising=False)
    return tmp_path / "spec.json"


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    rc = main(["--spec", *argv])
    out, err = capsys.readouterr()
    return rc, json.loads(out.splitlines()[-1]) if rc == 0 else {}, err


def test_relative_paths_start_at_the_data_root(spec_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    area = spec_file.parent / "teams" / "default"
    rc, plan, _ = _plan(capsys, str(spec_file), "--data-root", str(area))
    assert rc == 0 and plan["model_source"] == f"checkpoint {area / 'models' / 'tiny'}"
    assert plan["model"]["num_layers"] == 2


def test_the_workers_area_is_the_default_root(
    spec_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WRITE_ENV, str(spec_file.parent / "teams" / "default"))
    rc, plan, err = _plan(capsys, str(spec_file))
    assert rc == 0, err
    assert plan["model"]["hidden_size"] == 64
