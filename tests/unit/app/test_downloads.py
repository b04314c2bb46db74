"""Outputs over HTTP: artifacts list only files and directories, each with a download URL; a file is served with
Range support, a directory or a prefix's file set as a streamed tar; nothing outside the roots is ever served."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert

from core.db import session_scope
from core.jobs import transition
from core.models import Artifact
from core.paths import team_area
from core.settings import Settings
from core.states import JobState
from core_support import auth, isolated_settings, make_job, make_token


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return isolated_settings(tmp_path)


@pytest.fixture
def job(settings: Settings) -> str:
    data = team_area(settings, "alpha")
    (data / "hf" / "sub").mkdir(parents=True)
    (data / "hf" / "config.json").write_text('{"a": 1}')
    (data / "hf" / "sub" / "w.safetensors").write_bytes(bytes(range(256)) * 5)
    for suffix in (".bin", ".idx"):
        (data / f"ds_text_document{suffix}").write_bytes(suffix.encode() * 100)
    secret = settings.var_dir / "secret.txt"
    secret.write_text("no")
    job_id = make_job(settings, team="alpha")
    rows = [
        ("model", data / "hf", []),
        ("log", data / "hf" / "config.json", []),
        ("data_path", data / "ds", [data / "ds_text_document.bin", data / "ds_text_document.idx"]),
        ("checkpoint_iteration", Path("200"), []),
        ("files", Path("a.bin,b.idx"), []),
        ("leak", secret, []),
    ]
    with session_scope(settings.database_url) as session:
        session.execute(
            insert(Artifact),
            [
                {"job_id": job_id, "name": n, "path": str(p), "files": [str(f) for f in fs], "size_bytes": 1}
                for n, p, fs in rows
            ],
        )
        session.commit()
        assert transition(session, job_id, JobState.cancelled)
    return job_id


def test_downloads(settings: Settings, job: str) -> None:
    from app.main import create_app

    data = team_area(settings, "alpha")
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as api:
        listed = {a["name"]: a for a in api.get(f"/v1/jobs/{job}/artifacts").json()["data"]}
        assert set(listed) == {"model", "log", "data_path", "leak"}  # values are not artifacts
        whole = api.get(listed["log"]["download_url"])
        assert whole.status_code == 200 and whole.content == b'{"a": 1}'
        part = api.get(
            f"/v1/jobs/{job}/artifacts/model/download",
            params={"file": "sub/w.safetensors"},
            headers={"Range": "bytes=10-19"},
        )
        assert part.status_code == 206 and part.content == bytes(range(10, 20))
        archive = api.get(listed["model"]["download_url"])
        assert archive.status_code == 200 and archive.headers["content-type"] == "application/x-tar"
        with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
            names = sorted(tar.getnames())
            assert names == ["hf/config.json", "hf/sub/w.safetensors"]
            blob = tar.extractfile("hf/sub/w.safetensors")
            assert blob is not None and blob.read() == (data / "hf" / "sub" / "w.safetensors").read_bytes()
        with tarfile.open(fileobj=io.BytesIO(api.get(listed["data_path"]["download_url"]).content)) as tar:
            assert sorted(tar.getnames()) == ["ds_text_document.bin", "ds_text_document.idx"]
        one = api.get(listed["data_path"]["download_url"], params={"file": "ds_text_document.idx"})
        assert one.content == b".idx" * 100
        for url, params in [
            (listed["model"]["download_url"], {"file": "../../secret.txt"}),
            (listed["leak"]["download_url"], {}),
            (f"/v1/jobs/{job}/artifacts/checkpoint_iteration/download", {}),
            (f"/v1/jobs/{job}/artifacts/nope/download", {}),
        ]:
            refused = api.get(url, params=params)
            assert refused.status_code == 404 and "no" != refused.text, (url, refused.text)
        other = make_token(settings, "beta")
        assert api.get(listed["log"]["download_url"], headers=auth(other)).status_code == 404


def test_cli_artifacts_and_download(
    settings: Settings, job: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from app.main import create_app
    from cli import remote
    from cli.main import cli
    from llmjobs import Client

    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as http:
        monkeypatch.setattr(remote, "Client", lambda: Client(http=http))
        runner = CliRunner()
        listed = runner.invoke(cli, ["artifacts", job]).output
        assert listed.split()[:3] == ["NAME", "PATH", "BYTES"] and "checkpoint_iteration" not in listed
        out = runner.invoke(cli, ["download", job, "model", "-o", str(tmp_path / "m.tar")])
        assert out.exit_code == 0, out.output
        with tarfile.open(tmp_path / "m.tar") as tar:
            assert "hf/config.json" in tar.getnames()
        out = runner.invoke(cli, ["download", job, "log", "-o", str(tmp_path / "c.json")])
        assert out.exit_code == 0 and (tmp_path / "c.json").read_text() == '{"a": 1}'
        assert runner.invoke(cli, ["download", job, "nope"]).exit_code == 1


def test_a_link_among_a_teams_outputs_is_not_followed(settings: Settings) -> None:
    """Issue 25's replay: a writer in team red's area replaces red's output by a link to team blue's file (or puts a
    link inside an output directory, or records an output in blue's area): red's downloads never return blue's
    bytes."""
    from app.main import create_app

    red, blue = team_area(settings, "red"), team_area(settings, "blue")
    (blue / "out").mkdir(parents=True)
    (blue / "out" / "weights.bin").write_bytes(b"blue's bytes")
    (red / "model").mkdir(parents=True)
    (red / "model" / "config.json").write_text("{}")
    (red / "model" / "stolen.bin").symlink_to(blue / "out" / "weights.bin")
    (red / "model" / "stolen_dir").symlink_to(blue / "out")
    (red / "log.txt").symlink_to(blue / "out" / "weights.bin")
    (red / "linked").symlink_to(blue / "out")
    os.mkfifo(red / "pipe")  # opening it for reading would wait for a writer
    os.mkfifo(red / "model" / "pipe")
    job_id = make_job(settings, team="red")
    rows = {
        "log": red / "log.txt",
        "model": red / "model",
        "through": red / "linked" / "weights.bin",
        "blue": blue / "out" / "weights.bin",
        "dotdot": red / ".." / "blue" / "out" / "weights.bin",
        "pipe": red / "pipe",
    }
    with session_scope(settings.database_url) as session:
        session.execute(
            insert(Artifact),
            [{"job_id": job_id, "name": n, "path": str(p), "files": [], "size_bytes": 1} for n, p in rows.items()],
        )
        session.commit()
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "red"))) as api:
        url = f"/v1/jobs/{job_id}/artifacts/{{}}/download"
        for name in ("log", "through", "blue", "dotdot", "pipe"):
            answer = api.get(url.format(name))
            assert answer.status_code == 404 and answer.json()["code"] == "not_found", (name, answer.text)
        for member in ("stolen.bin", "stolen_dir/weights.bin", "pipe"):
            answer = api.get(url.format("model"), params={"file": member})
            assert answer.status_code == 404 and b"blue" not in answer.content, (member, answer.text)
        archive = api.get(url.format("model"))
        assert archive.status_code == 200 and b"blue's bytes" not in archive.content
        with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
            assert tar.getnames() == ["model/config.json"]


def test_a_bad_range_gets_the_json_error(settings: Settings, job: str) -> None:
    """starlette answers these in plain text; the API answers with its error shape (issue 25)."""
    from app.main import create_app

    url = f"/v1/jobs/{job}/artifacts/log/download"
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as api:
        for header in ("bytes", "pages=0-1", "bytes=5-2", "bytes=-"):
            answer = api.get(url, headers={"Range": header})
            assert answer.status_code == 400, (header, answer.text)
            assert answer.json()["code"] == "invalid_range" and answer.json()["field"] == "Range"
        past = api.get(url, headers={"Range": "bytes=1000-2000"})
        assert past.status_code == 416 and past.json()["code"] == "range_not_satisfiable"
        assert past.headers["content-range"] == "bytes */8"
        assert api.get(url, headers={"Range": "bytes=1-2"}).content == b'"a'
