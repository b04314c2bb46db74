"""Finding 4 at submission: every path of a spec resolves inside the caller's team area (``<root>/teams/<team>/``),
inputs also inside a shared read-only area; an output of ".", "" or the area itself (which wrote
``<root>_text_document.*`` beside the root), another team's area, the bare data root or a shared area is a 422 naming
the field, and nothing is stored."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from core.paths import team_area
from core.settings import Settings
from core_support import auth, isolated_settings, make_token, team_dir

BASE = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "out/x"}


def _outputs(settings: Settings, values: list[str]) -> list[tuple[str, dict]]:
    cases = []
    for value in values:
        cases.append(("output_prefix", {**BASE, "output_prefix": value}))
        cases.append(
            (
                "save_dir",
                {
                    "kind": "convert",
                    "load_model_type": "hf",
                    "save_model_type": "mg",
                    "load_dir": "hf",
                    "save_dir": value,
                },
            )
        )
        cases.append(("save", {"kind": "train", "data_path": "d", "train_iters": 1, "lr": 1e-3, "save": value}))
    return cases


def _refused(client: TestClient, token: str, cases: list[tuple[str, dict]], words: str) -> None:
    for field, spec in cases:
        answer = client.post("/v1/jobs", json=spec, headers=auth(token))
        assert answer.status_code == 422, (spec, answer.text[:300])
        assert answer.json()["field"] == field and words in answer.json()["message"], answer.json()
    assert client.get("/v1/jobs", headers=auth(token)).json()["data"] == []


def test_an_output_may_not_be_the_team_area(client: TestClient, settings: Settings) -> None:
    area = str(team_area(settings, "alpha"))
    cases = _outputs(settings, [".", "", area, area + "/", "./"])
    _refused(client, make_token(settings, "alpha"), cases, "data area itself")


def test_an_output_may_not_leave_the_team_area(client: TestClient, settings: Settings) -> None:
    root = settings.data_roots[0]
    outside = [str(root), str(root / "out"), str(team_area(settings, "beta") / "out"), str(root / "teams" / "x")]
    _refused(client, make_token(settings, "alpha"), _outputs(settings, outside), "outside your data area")


@pytest.mark.parametrize("field", ["input", "tokenizer_name_or_path"])
def test_an_input_of_another_team_is_refused(client: TestClient, settings: Settings, field: str) -> None:
    theirs = team_area(settings, "beta") / BASE[field]  # exists: the beta fixture made it
    assert theirs.exists()
    answer = client.post("/v1/jobs", json={**BASE, field: str(theirs)}, headers=auth(make_token(settings, "alpha")))
    assert answer.status_code == 422 and answer.json()["field"] == field, answer.text[:300]
    assert "outside your data area" in answer.json()["message"]


def test_a_symlink_out_of_the_area_is_refused_at_submission(client: TestClient, settings: Settings) -> None:
    (team_dir(settings, "alpha") / "peek").symlink_to(team_area(settings, "beta"))
    answer = client.post(
        "/v1/jobs", json={**BASE, "output_prefix": "peek/x"}, headers=auth(make_token(settings, "alpha"))
    )
    assert answer.status_code == 422 and answer.json()["field"] == "output_prefix", answer.text[:300]


@pytest.mark.parametrize("value", ["out/x", "./out/x", "x", "{area}/out/x"])
def test_outputs_inside_the_team_area_are_accepted(client: TestClient, settings: Settings, value: str) -> None:
    value = value.format(area=team_area(settings, "alpha"))
    answer = client.post("/v1/jobs", json={**BASE, "output_prefix": value}, headers=auth(make_token(settings, "alpha")))
    assert answer.status_code == 201, answer.text[:300]
    expected = team_area(settings, "alpha") / ("x" if value == "x" else "out/x")
    assert answer.json()["spec"]["output_prefix"] == str(expected)


def test_admins_get_their_own_team_area_only(client: TestClient, settings: Settings) -> None:
    token = make_token(settings, "ops", admin=True)
    _refused(client, token, _outputs(settings, [str(team_area(settings, "alpha") / "out")]), "outside your data area")


def test_a_shared_area_is_readable_not_writable(tmp_path: Path) -> None:
    settings = isolated_settings(tmp_path, shared_data_areas="shared")
    shared = settings.data_roots[0] / "shared"
    (shared / "tok").mkdir(parents=True)
    (shared / "in.jsonl").write_text('{"text": "hi"}\n')
    token = make_token(settings, "alpha")
    with TestClient(create_app(settings, reconcile=False)) as client:
        spec = {**BASE, "input": str(shared / "in.jsonl"), "tokenizer_name_or_path": str(shared / "tok")}
        answer = client.post("/v1/jobs", json=spec, headers=auth(token))
        assert answer.status_code == 201, answer.text[:300]
        assert answer.json()["spec"]["output_prefix"] == str(team_area(settings, "alpha") / "out" / "x")
        answer = client.post("/v1/jobs", json={**spec, "output_prefix": str(shared / "x")}, headers=auth(token))
        assert answer.status_code == 422 and answer.json()["field"] == "output_prefix", answer.text[:300]
        assert "outside your data area" in answer.json()["message"]


def test_a_team_name_must_name_a_directory(settings: Settings) -> None:
    for bad in ("..", "a/b", ".hidden", ""):
        with pytest.raises(ValueError, match="team name"):
            make_token(settings, bad)
