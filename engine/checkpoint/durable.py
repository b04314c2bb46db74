"""Durable writes: bytes on disk (fsync) before any name points at them, so a crash or a full disk leaves either the
previous file set or the new one, never a name over half-written bytes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_synced(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` then flush and fsync: on disk before anything names it."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fsync_file(path)  # a directory opened read-only fsyncs the same way on Linux


def fsync_tree(root: Path) -> None:
    """Every file under ``root``, then every directory bottom-up: all of it on disk before ``root`` is renamed."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(Path(folder, name))
        fsync_dir(Path(folder))


def replace_synced(path: Path, text: str) -> None:
    """Atomically make ``path`` hold ``text``: a synced temp file beside it renamed over it, the rename synced."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write_synced(tmp, lambda f: f.write(text.encode()))
    os.replace(tmp, path)
    fsync_dir(path.parent)
