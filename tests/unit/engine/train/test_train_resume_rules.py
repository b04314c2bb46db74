"""Resume rules of the train job run by a worker (LLMJOBS_JOB_ID set): a retry of the same job continues its own run;
another job continues it only with resume "auto" and iterations left; a run that trains 0 steps says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2]))
from engine.contract import owner  # noqa: E402
from engine.contract.runfiles import BadInput, RunDir  # noqa: E402
from engine.contract.spec import OUTPUT_KEYS, parse_spec  # noqa: E402
from engine.train import entry  # noqa: E402
from train_support import tiny_spec, write_instruction_data  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_instruction_data(tmp_path_factory.mktemp("data") / "sft", n=16)


def _events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["type"] == kind]


def _as_job(monkeypatch: pytest.MonkeyPatch, job_id: str, spec: dict, run_dir: Path) -> tuple[dict, dict]:
    monkeypatch.setenv(owner.JOB_ID_ENV, job_id)
    return entry.run(parse_spec(spec), RunDir(run_dir))


def test_another_jobs_run_needs_resume_auto_and_a_retry_of_zero_steps_warns(
    data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = tmp_path / "ckpt"
    spec = tiny_spec(data, train_iters=2, save_interval=2, save=str(save), name="first")
    outputs, _ = _as_job(monkeypatch, "job-a", spec, tmp_path / "a")
    assert set(outputs) <= set(OUTPUT_KEYS["train"])  # what pipelines may reference, checked at submission
    assert owner.saved_run(save) == owner.SavedRun(save / "train_state" / "iter_0000002", 2, "job-a", "first")

    with pytest.raises(BadInput, match="job job-a \\('first'\\) at iteration 2") as refused:
        _as_job(monkeypatch, "job-b", {**spec, "lr": 3e-3}, tmp_path / "b0")  # the resubmission
    assert refused.value.field == "save"
    with pytest.raises(BadInput, match="leaves nothing to train") as refused:
        _as_job(monkeypatch, "job-b", {**spec, "resume": "auto"}, tmp_path / "b1")
    assert refused.value.field == "train_iters"

    more = {**spec, "resume": "auto", "train_iters": 3, "save_interval": 1, "name": "second"}
    _, summary = _as_job(monkeypatch, "job-b", more, tmp_path / "b2")
    assert summary["resumed_from_job"] == "job-a" and summary["start_iteration"] == 2
    assert summary["trained_iterations"] == 1 and "warnings" not in summary
    [resumed] = _events(tmp_path / "b2", "resumed")
    assert "resumed from job job-a ('first') at iteration 2" in resumed["message"]
    claimed = owner.read_owner(save)
    assert claimed is not None and claimed["job_id"] == "job-b"
    assert claimed["resumed_from"] == {"job_id": "job-a", "iteration": 2}

    # The same job retried after its steps were all done: a success that says it trained nothing.
    _, again = _as_job(monkeypatch, "job-b", more, tmp_path / "b3")
    assert again["trained_iterations"] == 0 and again["resumed_from_job"] is None
    assert "trained 0 iterations" in again["warnings"][0]
    assert [e["data"]["trained_iterations"] for e in _events(tmp_path / "b3", "warning")] == [0]
    assert "this job's own checkpoint" in _events(tmp_path / "b3", "resumed")[0]["message"]


def test_a_fresh_save_is_claimed_and_a_run_without_marker_is_anothers(
    data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = tmp_path / "ckpt"
    spec = tiny_spec(data, train_iters=1, save_interval=1, save=str(save))
    monkeypatch.delenv(owner.JOB_ID_ENV, raising=False)
    entry.run(parse_spec(spec), RunDir(tmp_path / "standalone"))  # the engine run by hand: owner null
    assert owner.saved_run(save).job_id is None  # type: ignore[union-attr]
    (save / owner.OWNER_FILE).unlink()  # as a run from before owners were recorded
    with pytest.raises(BadInput, match="no recorded job") as refused:
        _as_job(monkeypatch, "job-c", spec, tmp_path / "c")
    assert refused.value.field == "save"
