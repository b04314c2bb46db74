"""Walking a team's files without following symbolic links: the one walk of the uploads, downloads and job inputs.

A team may plant links in its own area (to another team's area, or out of the roots). Resolving a path and then
opening it leaves a window in which a link can be swapped in; these helpers open each directory inside the one
before with ``O_NOFOLLOW`` instead, so a link met is refused (``LinkInPath``) and one swapped in after the look makes
the open fail, never followed. ``core.paths`` (uploads, downloads) and the engine's input guard
(``engine.contract.guard``) share them. No torch here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
# O_NONBLOCK: a FIFO planted in a folder must not hold the reader (no effect on a regular file's reads)
FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW


class LinkInPath(OSError):
    """A symbolic link met while walking a path that must not follow links; ``name`` is the link's name."""

    def __init__(self, name: str):
        super().__init__(f"{name!r} is a symbolic link")
        self.name = name


def lstat_at(name: str, dir_fd: int) -> os.stat_result:
    """``name`` in directory ``dir_fd``, not followed; ``LinkInPath`` for a symbolic link."""
    found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(found.st_mode):
        raise LinkInPath(name)
    return found


def open_dirs(base: Path, parts: Sequence[str]) -> list[int]:
    """Descriptors of ``base`` and of each directory ``parts`` names below it, each opened inside the one before
    with ``O_NOFOLLOW`` (a link met raises ``LinkInPath``; one swapped in after the look fails the open, never
    followed). The caller closes them; on an error none stay open."""
    opened = [os.open(base, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for part in parts:
            lstat_at(part, opened[-1])
            opened.append(os.open(part, DIR_FLAGS, dir_fd=opened[-1]))
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    return opened


def links_below(folder: Path, limit: int | None = None) -> Iterator[Path]:
    """Every symbolic link below directory ``folder``, in name order (links are listed, never followed or descended
    into); with ``limit``, only among the first ``limit`` entries."""
    seen = 0
    for top, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted((*dirs, *files)):
            seen += 1
            if limit is not None and seen > limit:
                return
            if os.path.islink(os.path.join(top, name)):
                yield Path(top) / name


def copy_tree(dir_fd: int, target: Path, budget: int) -> int:
    """Copy the directory ``dir_fd`` holds into the new directory ``target``, every entry opened inside its parent's
    descriptor with ``O_NOFOLLOW``: a symbolic link anywhere raises ``LinkInPath`` (named by its path below the
    folder), and anything but directories and regular files, or more than ``budget`` bytes in all, ``ValueError``.
    Returns the bytes copied."""
    left = [budget]
    _copy_dir(dir_fd, target, "", left)
    return budget - left[0]


def _copy_dir(dir_fd: int, target: Path, where: str, left: list[int]) -> None:
    target.mkdir(mode=0o700)
    for name in sorted(os.listdir(dir_fd)):
        try:
            found = lstat_at(name, dir_fd)
        except LinkInPath:
            raise LinkInPath(where + name) from None
        if stat.S_ISDIR(found.st_mode):
            sub = os.open(name, DIR_FLAGS, dir_fd=dir_fd)  # a link swapped in since the look: ELOOP
            try:
                _copy_dir(sub, target / name, f"{where}{name}/", left)
            finally:
                os.close(sub)
        elif stat.S_ISREG(found.st_mode):
            _copy_file(name, dir_fd, target / name, where, left)
        else:
            raise ValueError(f"{where}{name} is neither a file nor a directory")


def _copy_file(name: str, dir_fd: int, target: Path, where: str, left: list[int]) -> None:
    fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)  # a link swapped in since the look: ELOOP, never followed
    with os.fdopen(fd, "rb") as source, open(target, "xb") as out:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{where}{name} is not a regular file")
        while chunk := source.read(min(1 << 20, left[0] + 1)):
            left[0] -= len(chunk)
            if left[0] < 0:
                raise ValueError(f"{where}{name}: more bytes than the copy may take")
            out.write(chunk)
