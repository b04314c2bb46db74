"""``python -m engine <kind>`` without ``--run-dir`` writes its run files into a fresh ``runs/<kind>-<stamp>``, never
into the current directory itself; every rank of one torchrun agrees on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.contract.flags import spec_from_argv

ARGS = ["--input", "a.jsonl", "--tokenizer-name-or-path", "tok", "--output-prefix", "out/x"]


def test_no_run_dir_is_a_fresh_directory_below_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _, run_dir, _ = spec_from_argv("preprocess", ARGS)
    assert run_dir != Path(".") and run_dir.parent == Path("runs") and run_dir.name.startswith("preprocess-")
    assert spec_from_argv("preprocess", [*ARGS, "--run-dir", "mine"])[1] == Path("mine")


def test_ranks_of_one_torchrun_share_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert spec_from_argv("preprocess", ARGS)[1] == Path("runs") / "preprocess-torchrun-abc-29500"
