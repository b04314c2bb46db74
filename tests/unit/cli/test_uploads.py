"""Uploads over HTTP: streamed into the team's area of the data roots with a SHA-256, listed per team, never outside
it (absolute paths, '..', symbolic links refused), never over an existing file unless asked, never over the size
limit (nothing left behind); deleted one file at a time, never through a link; the CLI's ``upload``, ``files`` and
``delete-file`` on top of the SDK."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from app.main import create_app
from cli import remote
from cli.main import cli
from core.settings import Settings
from core_support import auth, isolated_settings, make_token, team_dir
from llmjobs import Client

LIMIT = 3_000_000  # above max_body_bytes (1 MB): uploads have their own limit


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path / "var", upload_max_bytes=LIMIT)


@pytest.fixture
def api(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as http:
        yield http


def area(settings: Settings, team: str = "alpha") -> Path:
    return team_dir(settings, team) / "uploads"


def leftovers(settings: Settings) -> list[str]:
    return [p.name for p in settings.data_roots[0].rglob(".upload-*")]


def test_upload_list_overwrite(api: TestClient, settings: Settings) -> None:
    body = os.urandom(2_000_000)  # larger than max_body_bytes: streamed, not refused
    put = api.put("/v1/files/data/train.jsonl", content=body)
    assert put.status_code == 201, put.text
    answer = put.json()
    target = area(settings) / "data" / "train.jsonl"
    assert answer["path"] == "data/train.jsonl" and answer["server_path"] == str(target)
    assert answer["sha256"] == hashlib.sha256(body).hexdigest() and answer["size_bytes"] == len(body)
    assert target.read_bytes() == body and not leftovers(settings)
    again = api.put("/v1/files/data/train.jsonl", content=b"other")
    assert again.status_code == 409 and again.json()["field"] == "path" and target.read_bytes() == body
    replaced = api.put("/v1/files/data/train.jsonl", content=b"other", params={"overwrite": "true"})
    assert replaced.status_code == 200 and target.read_bytes() == b"other"
    assert api.put("/v1/files/data/sub/a.txt", content=b"a").status_code == 201
    listed = api.get("/v1/files").json()
    assert [f["path"] for f in listed["data"]] == ["data/sub/a.txt", "data/train.jsonl"]
    assert listed["data"][1]["size_bytes"] == 5 and listed["data"][1]["sha256"] is None
    page = api.get("/v1/files", params={"limit": 1}).json()
    assert page["has_more"] and page["last_id"] == "data/sub/a.txt"
    assert [f["path"] for f in api.get("/v1/files", params={"after": "data/sub/a.txt"}).json()["data"]] == [
        "data/train.jsonl"
    ]
    assert api.get("/v1/files", headers=auth(make_token(settings, "beta"))).json()["data"] == []
    assert api.put("/v1/files/data", content=b"x").status_code == 409  # a directory
    assert api.put("/v1/files/data/train.jsonl/x", content=b"x").status_code == 409  # a file as a directory
    assert api.put("/v1/files/x", content=b"x", headers={"Authorization": "Bearer llmj_wrong"}).status_code == 401


@pytest.mark.parametrize(
    "path",
    ["%2E%2E/escape.txt", "a/%2E%2E/%2E%2E/escape.txt", "%2Fetc/escape.txt", "a//b", "a/%2E/b", "a%5Cb", ".upload-x"],
)
def test_paths_that_leave_the_area_are_refused(api: TestClient, settings: Settings, path: str) -> None:
    response = api.put(f"/v1/files/{path}", content=b"x")
    assert response.status_code == 422 and response.json()["field"] == "path", response.text
    assert not list(settings.var_dir.rglob("escape.txt")) and not (settings.var_dir.parent / "escape.txt").exists()


@pytest.mark.parametrize("path", ["bad%FFname.txt", "dir%C3/x.txt", "a%ED%A0%80b.txt"], ids=["FF", "cut", "surrogate"])
def test_names_that_are_not_utf8_are_refused_not_replaced(api: TestClient, settings: Settings, path: str) -> None:
    """A name whose percent-escapes are not UTF-8 was stored with U+FFFD in their place (issue 25)."""
    response = api.put(f"/v1/files/{path}", content=b"x")
    assert response.status_code == 400 and response.json()["field"] == "path", response.text
    assert "UTF-8" in response.json()["message"]
    assert api.get("/v1/files").json()["data"] == [] and not list(settings.data_roots[0].rglob("*.txt"))
    assert api.get("/v1/files", params={"prefix": "x"}).status_code == 200
    assert api.get("/v1/files?prefix=%FF").status_code == 400


def test_symbolic_links_are_never_followed(api: TestClient, settings: Settings, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    area(settings).mkdir(parents=True)
    (area(settings) / "link").symlink_to(outside, target_is_directory=True)
    (area(settings) / "file-link").symlink_to(outside / "f.txt")
    for path in ["link/x.txt", "file-link"]:
        response = api.put(f"/v1/files/{path}", content=b"x", params={"overwrite": "true"})
        assert response.status_code == 422 and "symbolic link" in response.json()["message"], response.text
    assert list(outside.iterdir()) == []
    assert api.get("/v1/files").json()["data"] == []  # links are not listed


def test_delete_removes_the_file_and_the_directories_it_empties(api: TestClient, settings: Settings) -> None:
    for path in ("d/sub/a.txt", "d/b.txt"):
        assert api.put(f"/v1/files/{path}", content=b"x").status_code == 201
    gone = api.delete("/v1/files/d/sub/a.txt")
    assert gone.status_code == 200 and gone.json() == {"object": "file.deleted", "path": "d/sub/a.txt", "deleted": True}
    assert not (area(settings) / "d" / "sub").exists() and (area(settings) / "d" / "b.txt").exists()
    assert api.delete("/v1/files/d/sub/a.txt").json()["code"] == "not_found"
    assert api.delete("/v1/files/d").status_code == 409  # a directory
    assert api.delete("/v1/files/d/b.txt/x").status_code == 404  # a file where a directory would be
    other = auth(make_token(settings, "beta"))
    assert api.delete("/v1/files/d/b.txt", headers=other).status_code == 404  # another team's area
    assert api.delete("/v1/files/d/b.txt").status_code == 200
    assert area(settings).is_dir() and list(area(settings).iterdir()) == []  # the area itself stays
    assert api.delete("/v1/files/%2E%2E/x").json()["field"] == "path"


def test_delete_never_follows_a_link(api: TestClient, settings: Settings, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f.txt").write_text("keep")
    area(settings).mkdir(parents=True)
    (area(settings) / "link").symlink_to(outside, target_is_directory=True)
    (area(settings) / "file-link").symlink_to(outside / "f.txt")
    for path in ("link/f.txt", "file-link"):
        response = api.delete(f"/v1/files/{path}")
        assert response.status_code == 422 and "symbolic link" in response.json()["message"], response.text
    assert (outside / "f.txt").read_text() == "keep" and (area(settings) / "file-link").is_symlink()


def test_over_the_limit_is_413_and_leaves_nothing(api: TestClient, settings: Settings) -> None:
    declared = api.put("/v1/files/big.bin", content=b"x" * (LIMIT + 1))
    assert declared.status_code == 413 and declared.json()["code"] == "payload_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
        for _ in range(LIMIT // 65536 + 2):
            yield b"y" * 65536

    streamed = api.put("/v1/files/big.bin", content=chunks())
    assert streamed.status_code == 413, streamed.text
    assert not (area(settings) / "big.bin").exists() and not leftovers(settings)


def test_the_team_storage_quota_is_enforced_on_upload(settings: Settings) -> None:
    """``team_storage_quota_bytes`` counts every file of the team's areas (job outputs too); other teams are apart."""
    quota = settings.model_copy(update={"team_storage_quota_bytes": 1000})
    (team_dir(quota, "alpha") / "out").mkdir(parents=True)
    (team_dir(quota, "alpha") / "out" / "model.bin").write_bytes(b"m" * 600)  # a job's output
    with TestClient(create_app(quota, reconcile=False), headers=auth(make_token(quota, "alpha"))) as api:
        assert api.put("/v1/files/a.bin", content=b"a" * 300).status_code == 201
        declared = api.put("/v1/files/b.bin", content=b"b" * 101)
        assert declared.status_code == 413, declared.text
        assert declared.json()["code"] == "storage_quota_exceeded"
        assert "100 bytes left of its 1000-byte storage quota" in declared.json()["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
            yield b"c" * 60
            yield b"c" * 60

        streamed = api.put("/v1/files/c.bin", content=chunks())
        assert streamed.status_code == 413 and streamed.json()["code"] == "storage_quota_exceeded"
        assert api.put("/v1/files/a.bin", params={"overwrite": "true"}, content=b"a" * 400).status_code == 200
        assert api.put("/v1/files/b.bin", content=b"b").status_code == 413
        assert sorted(f["path"] for f in api.get("/v1/files").json()["data"]) == ["a.bin"] and not leftovers(quota)
        beta = api.put("/v1/files/x.bin", content=b"x" * 900, headers=auth(make_token(quota, "beta")))
        assert beta.status_code == 201


def test_openapi_declares_the_upload_errors(api: TestClient) -> None:
    operation = api.get("/openapi.json").json()["paths"]["/v1/files/{path}"]["put"]
    for code in ("400", "401", "409", "413", "422"):
        assert operation["responses"][code]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorBody"
        }, code
    assert "application/octet-stream" in operation["requestBody"]["content"]


def test_cli_upload_and_files(
    api: TestClient, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote, "Client", lambda: Client(http=api))
    model = tmp_path / "tiny"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "sub" / "w.bin").write_bytes(b"12345")
    single = tmp_path / "demo.jsonl"
    single.write_text('{"text": "hi"}\n')
    result = CliRunner().invoke(cli, ["upload", str(single)])
    assert result.exit_code == 0, result.output
    assert result.output.split()[0] == str(area(settings) / "demo.jsonl")
    assert hashlib.sha256(single.read_bytes()).hexdigest() in result.output
    result = CliRunner().invoke(cli, ["upload", str(model), "models/tiny"])
    assert result.exit_code == 0, result.output
    assert [line.split()[0] for line in result.output.splitlines()] == [
        str(area(settings) / "models/tiny/config.json"),
        str(area(settings) / "models/tiny/sub/w.bin"),
    ]
    refused = CliRunner().invoke(cli, ["upload", str(single)])
    assert refused.exit_code == 1 and "409" in refused.output and "overwrite" in refused.output
    assert CliRunner().invoke(cli, ["upload", str(single), "--overwrite"]).exit_code == 0
    listed = CliRunner().invoke(cli, ["files"])
    assert [line.split()[0] for line in listed.output.splitlines()] == [
        "PATH",
        "demo.jsonl",
        "models/tiny/config.json",
        "models/tiny/sub/w.bin",
    ]
    assert CliRunner().invoke(cli, ["delete-file", "models/tiny/sub/w.bin"]).exit_code == 0
    assert not (area(settings) / "models/tiny/sub").exists()
    missing = CliRunner().invoke(cli, ["delete-file", "models/tiny/sub/w.bin"])
    assert missing.exit_code == 1 and "404" in missing.output
