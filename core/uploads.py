"""Files a team uploads over HTTP: ``uploads/`` inside the team's data area of the first data root
(``core.paths.team_area``: ``<root>/teams/<team>/uploads/``), and the path rules.

A job can only read inside its team's areas, so an upload lands there, and its server path
is what a spec then names (``input``, ``data_path``, ``tokenizer``, ``load``). The destination is a relative path
checked word by word: no absolute path, ``..``, ``.``, empty part, backslash or control character, and no part of
it may be an existing symbolic link (a link could point out of the area). The bytes go to a hidden temporary file
next to the destination, opened with ``O_EXCL | O_NOFOLLOW``, and are moved into place only once complete (a cut
upload leaves nothing behind): ``os.link`` when an existing file must not be replaced (atomic refusal),
``os.replace`` when ``overwrite`` was asked. Deleting walks the path one directory at a time through file
descriptors opened with ``O_NOFOLLOW`` (``delete_file``), so a link swapped in after a check is never followed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from core.errors import ApiError
from core.paths import team_area, team_areas
from core.settings import Settings
from engine.contract.nofollow import LinkInPath, lstat_at, open_dirs

UPLOADS = "uploads"
MAX_PATH_CHARS = 1024
MAX_PARTS = 32
_PART_PREFIX = ".upload-"


@dataclass(frozen=True)
class StoredFile:
    path: str  # relative to the team's area
    server_path: str  # absolute, as a job spec names it
    size_bytes: int
    modified_at: datetime


def upload_area(settings: Settings, team: str) -> Path:
    """``<team's area in the first data root>/uploads`` (not created here)."""
    try:
        return team_area(settings, team) / UPLOADS
    except ValueError as err:
        raise ApiError(400, "bad_request", str(err)) from err


def checked_path(path: str) -> str:
    """``path`` as a clean relative path, or 422 naming ``path`` with the reason."""

    def refuse(why: str) -> ApiError:
        return ApiError(422, "validation_error", f"path: {why}", "path")

    if not path or len(path) > MAX_PATH_CHARS:
        raise refuse(f"give a relative file path of 1 to {MAX_PATH_CHARS} characters")
    if path.startswith("/"):
        raise refuse(f"{path[:80]!r} is absolute; give a path relative to your team's upload area")
    if "\\" in path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise refuse("backslashes and control characters are not allowed")
    parts = path.split("/")
    if len(parts) > MAX_PARTS:
        raise refuse(f"at most {MAX_PARTS} directory levels")
    for part in parts:
        if part in ("", ".", ".."):
            raise refuse(f"{path[:80]!r} has an empty, '.' or '..' part; paths may not leave the upload area")
        if len(part.encode("utf-8", "surrogatepass")) > 255:
            raise refuse(f"{part[:40]!r}...: a name is at most 255 bytes")
        if part.startswith(_PART_PREFIX):
            raise refuse(f"names starting with {_PART_PREFIX!r} are reserved")
    return "/".join(parts)


def destination(settings: Settings, team: str, path: str, overwrite: bool) -> Path:
    """Where ``path`` goes for ``team``, refused when a part of it is a link, a file stands where a directory must,
    or the file exists and ``overwrite`` is false (409)."""
    base = upload_area(settings, team)
    target = base.joinpath(*checked_path(path).split("/"))
    root = settings.data_roots[0].resolve()
    current = root
    for part in target.relative_to(root).parts:
        current = current / part
        if current.is_symlink():
            raise ApiError(
                422,
                "validation_error",
                f"path: {current.name!r} is a symbolic link; uploads never follow links",
                "path",
            )
        if current != target and current.exists() and not current.is_dir():
            raise ApiError(409, "conflict", f"path: {current.name!r} is a file, not a directory", "path")
    if target.is_dir():
        raise ApiError(409, "conflict", f"path: {path} is a directory", "path")
    if target.exists() and not overwrite:
        raise ApiError(409, "conflict", f"path: {path} exists; pass overwrite=true to replace it", "path")
    return target


def stored_bytes(settings: Settings, team: str) -> int:
    """The bytes of the regular files in ``team``'s areas of every data root (links neither followed nor counted;
    unfinished uploads counted)."""
    total = 0
    for area in team_areas(settings, team).write:
        for directory, _dirs, files in os.walk(area, followlinks=False):
            for name in files:
                try:
                    found = os.lstat(os.path.join(directory, name))
                except OSError:
                    continue  # removed meanwhile
                total += found.st_size if stat.S_ISREG(found.st_mode) else 0
    return total


class Quota:
    """``team``'s storage quota (``team_storage_quota_bytes``) as one upload of ``target`` sees it: ``room`` is
    what the upload may add, measured when it starts (``check``) and again before it is committed."""

    def __init__(self, settings: Settings, team: str, target: Path):
        self.settings, self.team, self.limit = settings, team, settings.team_storage_quota_bytes
        self.replaced = target.stat().st_size if target.is_file() else 0  # an overwrite frees the old file's bytes
        self.room = self.limit

    def check(self, adding: int, on_disk: int = 0) -> None:
        """413 when the team's stored bytes plus ``adding`` (less the file it replaces and the ``on_disk`` bytes of
        this upload already counted) pass the quota."""
        if not self.limit:
            return
        used = stored_bytes(self.settings, self.team) - self.replaced - on_disk
        self.room = self.limit - used
        if adding > self.room:
            raise self.refusal(adding)

    def refusal(self, adding: int) -> ApiError:
        return ApiError(
            413,
            "storage_quota_exceeded",
            f"team {self.team!r} has {max(self.room, 0)} bytes left of its {self.limit}-byte storage quota; this "
            f"upload needs {adding} (setting team_storage_quota_bytes: delete files or outputs, or ask an admin)",
        )


def start(settings: Settings, team: str, target: Path, declared: int | None) -> Upload:
    """An ``Upload`` of ``target`` for ``team``, refused at once (413) when the declared size passes the quota."""
    quota = Quota(settings, team, target)
    quota.check(declared or 0)
    return Upload(settings, target, settings.upload_max_bytes, quota)


class Upload:
    """One upload in progress: ``write`` chunks, then ``commit`` (or ``discard`` on any failure)."""

    def __init__(self, settings: Settings, target: Path, max_bytes: int, quota: Quota | None = None):
        self.target, self.max_bytes, self.quota = target, max_bytes, quota
        self.base = settings.data_roots[0].resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        parent = target.parent.resolve()  # a link raced in after ``destination`` looked: refuse
        if self.base not in parent.parents:
            raise ApiError(422, "validation_error", "path: resolves outside the upload area", "path")
        self.part = target.parent / f"{_PART_PREFIX}{uuid.uuid4().hex}"
        fd = os.open(self.part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        self.out: BinaryIO = os.fdopen(fd, "wb")
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise ApiError(
                413, "payload_too_large", f"the upload is larger than {self.max_bytes} bytes (setting upload_max_bytes)"
            )
        if self.quota is not None and self.quota.limit and self.size > self.quota.room:
            raise self.quota.refusal(self.size)
        self.digest.update(chunk)
        self.out.write(chunk)

    def commit(self, overwrite: bool) -> bool:
        """Move the complete file into place; whether it replaced an existing one. The quota is checked again with
        this file (and any upload running beside it) on disk."""
        self.out.close()
        if self.quota is not None:
            self.quota.check(self.size, on_disk=self.size)  # again with the uploads that ran beside this one
        existed = self.target.exists()
        if overwrite:
            if self.target.is_dir():
                raise ApiError(409, "conflict", f"path: {self.target.name} is a directory", "path")
            os.replace(self.part, self.target)
            return existed
        try:
            os.link(self.part, self.target)  # fails if the file appeared meanwhile: never replaced silently
        except FileExistsError as err:
            raise ApiError(409, "conflict", "path: the file exists; pass overwrite=true to replace it", "path") from err
        except OSError:  # a filesystem without hard links: check, then move (a narrow race instead of none)
            if self.target.exists():
                raise ApiError(
                    409, "conflict", "path: the file exists; pass overwrite=true to replace it", "path"
                ) from None
            os.replace(self.part, self.target)
            return False
        os.unlink(self.part)
        return False

    def discard(self) -> None:
        self.out.close()
        self.part.unlink(missing_ok=True)


def list_files(settings: Settings, team: str, prefix: str | None = None) -> list[StoredFile]:
    """The team's uploaded files (links and unfinished uploads left out), sorted by path."""
    base = upload_area(settings, team)
    root = base.joinpath(*checked_path(prefix).split("/")) if prefix else base
    if root.is_symlink() or not root.is_dir():
        return []
    found = []
    for directory, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = [d for d in dirs if not (Path(directory) / d).is_symlink()]
        for name in files:
            file = Path(directory) / name
            if name.startswith(_PART_PREFIX) or file.is_symlink() or not file.is_file():
                continue
            stat = file.stat()
            found.append(
                StoredFile(
                    path=file.relative_to(base).as_posix(),
                    server_path=str(file),
                    size_bytes=stat.st_size,
                    modified_at=datetime.fromtimestamp(stat.st_mtime, tz=timezone.utc),
                )
            )
    return sorted(found, key=lambda f: f.path)


def delete_file(settings: Settings, team: str, path: str) -> None:
    """Remove one of ``team``'s uploaded files, then the directories that leaves empty (up to the upload area).
    404 when there is no such file, 409 for a directory, 422 when a part of the path is a symbolic link."""
    parts = checked_path(path).split("/")
    missing = ApiError(404, "not_found", f"path: no uploaded file {path}", "path")
    opened: list[int] = []
    try:
        opened = open_dirs(upload_area(settings, team), parts[:-1])
        if stat.S_ISDIR(lstat_at(parts[-1], opened[-1]).st_mode):
            raise ApiError(409, "conflict", f"path: {path} is a directory; delete its files", "path")
        os.unlink(parts[-1], dir_fd=opened[-1])
        for depth in range(len(parts) - 1, 0, -1):  # the now-empty directories, innermost first
            try:
                os.rmdir(parts[depth - 1], dir_fd=opened[depth - 1])
            except OSError:
                break  # not empty (or in use): keep it and everything above
    except LinkInPath as err:
        raise ApiError(
            422, "validation_error", f"path: {err.name!r} is a symbolic link; uploads never follow links", "path"
        ) from None
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            raise missing from None
        if err.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise ApiError(422, "validation_error", "path: goes through a symbolic link", "path") from None
        raise
    finally:
        for fd in opened:
            os.close(fd)
