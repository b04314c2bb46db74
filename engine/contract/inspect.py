"""The one torch-free checkpoint inspector: which format a directory holds, the Megatron tracker → iteration
directory, and (``engine.contract.plan.shape``) the model shape of any checkpoint kind. Admission and the engine's loaders
both call it, so a directory the service admits is one the engine can open.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Literal

from engine.contract.runfiles import BadInput

log = logging.getLogger(__name__)

Format = Literal["hf", "mcore", "native"]
TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_MCORE_ENTRY = re.compile(r"^(iter_\d{7}|release|mp_rank_\d\d)")


def checkpoint_format(p: Path) -> Format | None:
    """``hf`` (config.json + safetensors), ``mcore`` (a tracker or ``iter_*``/``mp_rank_*`` folders), ``native``
    (torch DCP ``.metadata``, ours), or None when the directory holds none of them."""
    names = {e.name for e in p.iterdir()}
    if "config.json" in names and any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        return "hf"
    if _dcp_inside(p):
        return "native"
    if TRACKER in names or any(_MCORE_ENTRY.match(n) for n in names):
        return "mcore"
    return None


def _dcp_inside(p: Path) -> bool:
    if (p / ".metadata").is_file():
        return True
    tracker = p / TRACKER
    if tracker.is_file():
        step = read_tracker(tracker)
        sub = p / (f"iter_{int(step):07d}" if step.isascii() and step.isdigit() else step)
        return (sub / ".metadata").is_file()
    return any((d / ".metadata").is_file() for d in p.glob("iter_*"))


def read_tracker(tracker: Path) -> str:
    """The tracker's word (an iteration number or ``release``): its first 64 bytes, whatever the file's size."""
    with tracker.open("rb") as f:
        return f.read(64).decode("utf-8", "replace").strip()


def iteration_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def resolve_iteration_dir(root: str | os.PathLike[str]) -> tuple[Path, int | str | None]:
    """The directory holding the ``mp_rank_*`` folders, and its iteration, following Megatron's tracker rules."""
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"{root}: checkpoint directory not found", field="load_dir")
    if any(_RANK_DIR_RE.match(p.name) for p in root.iterdir()):
        return root, None  # pointed straight at iter_XXXXXXX/
    tracker = root / TRACKER
    iters = sorted(p for p in root.glob("iter_[0-9]*") if p.is_dir())
    if not tracker.is_file():
        if not iters:
            raise BadInput(
                f"{root}: no {TRACKER} and no iter_*/ directory: not a Megatron checkpoint", field="load_dir"
            )
        log.warning("%s: no %s; using the newest directory %s", root, TRACKER, iters[-1].name)
        return iters[-1], int(iters[-1].name[5:])
    text = read_tracker(tracker)
    if text == "release":
        if not (root / "release").is_dir():
            found = f" but the checkpoint has {', '.join(p.name for p in iters)}" if iters else ""
            raise BadInput(
                f"{tracker}: says 'release'{found}; an iteration number is needed (e.g. "
                f"{int(iters[-1].name[5:]) if iters else 1})",
                field="load_dir",
            )
        return root / "release", "release"
    try:
        iteration = int(text)
    except ValueError:
        raise BadInput(
            f"{tracker}: must hold an iteration number or 'release', found {text[:40]!r}", field="load_dir"
        ) from None
    if iteration <= 0:
        raise BadInput(f"{tracker}: iteration must be positive, found {iteration}", field="load_dir")
    path = root / iteration_dir_name(iteration)
    if not path.is_dir():
        raise BadInput(f"{tracker}: says iteration {iteration} but {path} does not exist", field="load_dir")
    return path, iteration
