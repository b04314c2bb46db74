"""Run-directory chores shared by the node runner (``worker.node``) and ``llmjobs run``: write ``spec.json``, read
the last log lines for a failure report, record a finished job's outputs as artifacts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import delete

from core.db import session_scope
from core.models import Artifact
from core.settings import Settings

LOG_TAIL_LINES = 40


def write_spec(run_dir: Path, spec: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    tmp = run_dir / ".spec.json.tmp"
    tmp.write_text(json.dumps(spec, indent=2))
    tmp.replace(run_dir / "spec.json")


def log_tail(run_dir: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of the launcher log (all ranks' stderr), else of rank 0's log."""
    for name in ("launcher.log", "rank0.log"):
        path = run_dir / "logs" / name
        if path.exists() and path.stat().st_size:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 64_000))
                return "\n".join(f.read().decode("utf-8", errors="replace").splitlines()[-lines:])
    return ""


def record_artifacts(settings: Settings, job_id: str, outputs: dict[str, str]) -> None:
    with session_scope(settings.database_url) as session:
        session.execute(delete(Artifact).where(Artifact.job_id == job_id))
        for name, value in outputs.items():
            files = _artifact_files(Path(value))
            session.add(
                Artifact(
                    job_id=job_id,
                    name=name,
                    path=value,
                    files=[str(f) for f in files[:1000]],
                    size_bytes=sum(f.stat().st_size for f in files) if files else None,
                )
            )


def _artifact_files(path: Path) -> list[Path]:
    """A directory's files, a file, or the files sharing a prefix (Megatron's ``<prefix>_*.bin/.idx``)."""
    if not path.is_absolute():  # an output that is not a path (e.g. a list of names)
        return []
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    if path.is_file():
        return [path]
    return sorted(p for p in path.parent.glob(path.name + "*") if p.is_file()) if path.parent.is_dir() else []
