"""What a job's artifact is on disk, for download: one file, or a set of files streamed as a tar archive.

Only paths inside the data roots or the job's run directory are served, resolved (symlinks followed) before the
check, so an artifact row can never make the service read another file. The tar stream is written here with the
standard library's ``TarInfo.tobuf`` headers and the files' bytes read in chunks: ``tarfile.add`` would buffer a
whole file (a multi-GB safetensors shard) before the first byte could be sent.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import ApiError
from core.models import Artifact

CHUNK = 1 << 20


@dataclass(frozen=True)
class Download:
    """``file`` for a single file (served with Range support), else ``members``: (path, name in the archive)."""

    file: Path | None
    members: list[tuple[Path, str]]
    archive_name: str


def job_artifact(session: Session, job_id: str, name: str) -> Artifact:
    """The job's artifact called ``name``, or 404 naming it."""
    artifact = session.scalar(select(Artifact).where(Artifact.job_id == job_id, Artifact.name == name))
    if artifact is None:
        raise ApiError(404, "not_found", f"job {job_id} has no artifact {name!r}", "name")
    return artifact


def is_real(artifact: Artifact) -> bool:
    """Outputs that name files or directories (not a count, an iteration number or a list written as a string)."""
    path = Path(artifact.path)
    return path.is_absolute() and (path.exists() or bool(artifact.files))


def _allowed(path: Path, roots: list[Path]) -> Path:
    resolved = path.resolve()
    if not any(resolved == r or r in resolved.parents for r in roots):
        raise ApiError(404, "not_found", f"{path} is not inside the data roots or the run directory", None)
    return resolved


def locate(artifact: Artifact, roots: list[Path], member: str | None = None) -> Download:
    """The file or files of ``artifact`` (``member``: one file inside a directory artifact, by relative path)."""
    if not is_real(artifact):
        raise ApiError(404, "not_found", f"artifact {artifact.name!r} is a value, not a file or directory", "name")
    root = Path(artifact.path)
    if member is not None:
        if root.is_dir():
            target = _allowed(root / member, roots)
            if _allowed(root, roots) not in target.parents:  # "../x" or a link out of the directory
                raise ApiError(404, "not_found", f"file: {member!r} is not inside artifact {artifact.name!r}", "file")
        else:  # a prefix artifact (Megatron's <prefix>_*.bin/.idx): its files by name
            named = [Path(f) for f in artifact.files if Path(f).name == member]
            if not named:
                raise ApiError(
                    404, "not_found", f"file: {member!r} is not a file of artifact {artifact.name!r}", "file"
                )
            target = _allowed(named[0], roots)
        if not target.is_file():
            raise ApiError(404, "not_found", f"file: {member!r} is not a file of artifact {artifact.name!r}", "file")
        return Download(target, [], target.name)
    if root.is_file():
        return Download(_allowed(root, roots), [], root.name)
    if root.is_dir():
        base = _allowed(root, roots)
        files = sorted(p for p in base.rglob("*") if p.is_file() and not p.is_symlink())
        return Download(None, [(p, f"{root.name}/{p.relative_to(base)}") for p in files], f"{root.name}.tar")
    files = [_allowed(Path(f), roots) for f in artifact.files]
    return Download(None, [(p, p.name) for p in files if p.is_file()], f"{root.name}.tar")


def tar_stream(members: list[tuple[Path, str]]) -> Iterator[bytes]:
    """An uncompressed POSIX (pax) tar of ``members``, produced chunk by chunk."""
    for path, name in members:
        stat = path.stat()
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = stat.st_size, int(stat.st_mtime), 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        sent = 0
        with open(path, "rb") as f:
            while sent < info.size and (chunk := f.read(min(CHUNK, info.size - sent))):
                sent += len(chunk)
                yield chunk
        if sent < info.size:  # the file shrank while being sent: keep the archive well formed
            yield b"\0" * (info.size - sent)
        if info.size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
