"""What a job's artifact is on disk, for download: one file, or a set of files streamed as a tar archive.

Only paths inside the job's team's areas or its run directory are served, and they are reached from there one
directory at a time without following any symbolic link (``nofollow.open_dirs``, as upload deletion walks): a link
planted among a team's outputs (to another team's file, to a secret) is refused, not followed, so an artifact row
can never make the service read another file. The tar stream is written here with the
standard library's ``TarInfo.tobuf`` headers and the files' bytes read in chunks: ``tarfile.add`` would buffer a
whole file (a multi-GB safetensors shard) before the first byte could be sent.
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import ApiError
from core.models import Artifact
from engine.contract.nofollow import lstat_at, open_dirs

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


def _not_found(path: Path) -> ApiError:
    return ApiError(404, "not_found", f"{path} is not a file or directory inside the job's team's areas", None)


def _inside(path: Path, areas: list[Path]) -> tuple[Path, list[str]]:
    """(the area ``path`` lies in, the names below it), by its words alone; 404 outside every area."""
    if path.is_absolute() and ".." not in path.parts:
        for area in areas:
            if path == area or area in path.parents:
                return area, list(path.relative_to(area).parts)
    raise _not_found(path)


def open_nofollow(path: Path, areas: list[Path], flags: int = os.O_RDONLY) -> int:
    """A descriptor of ``path`` reached from its area without following a link; 404 for a link, anything missing
    or a path outside the areas."""
    area, parts = _inside(path, areas)
    try:
        dirs = open_dirs(area, parts[:-1])
    except OSError:
        raise _not_found(path) from None
    try:
        if not parts:
            return os.dup(dirs[-1])
        lstat_at(parts[-1], dirs[-1])
        # O_NONBLOCK: a FIFO planted as an output must not hold the thread (no effect on a regular file's reads)
        return os.open(parts[-1], flags | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0), dir_fd=dirs[-1])
    except OSError:
        raise _not_found(path) from None
    finally:
        for fd in dirs:
            os.close(fd)


def _kind(path: Path, areas: list[Path]) -> int:
    """The file type bits of ``path`` (``stat.S_IFREG``/``S_IFDIR``), reached without following a link; 0 otherwise."""
    try:
        fd = open_nofollow(path, areas)
    except ApiError:
        return 0
    try:
        return stat.S_IFMT(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def _file(path: Path, areas: list[Path], refused: ApiError | None = None) -> Path:
    if _kind(path, areas) != stat.S_IFREG:
        raise refused or _not_found(path)
    return path


def _files_under(root: Path, areas: list[Path]) -> list[Path]:
    """The regular files below directory ``root``, links neither followed nor listed."""
    fd = open_nofollow(root, areas, os.O_RDONLY | os.O_DIRECTORY)
    found = []
    try:
        for top, _dirs, files, top_fd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
            for name in files:
                if stat.S_ISREG(os.stat(name, dir_fd=top_fd, follow_symlinks=False).st_mode):
                    found.append(Path(os.path.normpath(root / top / name)))
    finally:
        os.close(fd)
    return sorted(found)


def locate(artifact: Artifact, areas: list[Path], member: str | None = None) -> Download:
    """The file or files of ``artifact`` (``member``: one file inside a directory artifact, by relative path), each
    inside ``areas`` (``core.paths.download_areas``) and reached without following a link."""
    if not is_real(artifact):
        raise ApiError(404, "not_found", f"artifact {artifact.name!r} is a value, not a file or directory", "name")
    root = Path(artifact.path)
    _inside(root, areas)
    kind = _kind(root, areas)
    if member is not None:
        refused = ApiError(404, "not_found", f"file: {member!r} is not a file of artifact {artifact.name!r}", "file")
        if kind == stat.S_IFDIR:
            target = root / member
            if ".." in Path(member).parts or root not in target.parents:
                raise ApiError(404, "not_found", f"file: {member!r} is not inside artifact {artifact.name!r}", "file")
        else:  # a prefix artifact (Megatron's <prefix>_*.bin/.idx): its files by name
            named = [Path(f) for f in artifact.files if Path(f).name == member]
            if not named:
                raise refused
            target = named[0]
        return Download(_file(target, areas, refused), [], target.name)
    if kind == stat.S_IFREG:
        return Download(root, [], root.name)
    if kind == stat.S_IFDIR:
        files = _files_under(root, areas)
        return Download(None, [(p, f"{root.name}/{p.relative_to(root)}") for p in files], f"{root.name}.tar")
    if not artifact.files:  # neither a file nor a directory (a link, or gone), and no file set
        raise _not_found(root)
    files = [Path(f) for f in artifact.files if _kind(Path(f), areas) == stat.S_IFREG]
    return Download(None, [(p, p.name) for p in files], f"{root.name}.tar")


def tar_stream(members: list[tuple[Path, str]], areas: list[Path]) -> Iterator[bytes]:
    """An uncompressed POSIX (pax) tar of ``members``, produced chunk by chunk; each opened as ``locate`` checked it
    (a member that became a link since is left out)."""
    for path, name in members:
        try:
            fd = open_nofollow(path, areas)
        except ApiError:
            continue
        with os.fdopen(fd, "rb") as f:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                continue
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = found.st_size, int(found.st_mtime), 0o644
            yield info.tobuf(format=tarfile.PAX_FORMAT)
            sent = 0
            while sent < info.size and (chunk := f.read(min(CHUNK, info.size - sent))):
                sent += len(chunk)
                yield chunk
        if sent < info.size:  # the file shrank while being sent: keep the archive well formed
            yield b"\0" * (info.size - sent)
        if info.size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)
