"""Team-private data areas: where a team's jobs may read and write inside the data roots.

Every team owns ``<root>/teams/<team>/`` in each data root (``team_area``). A job reads and writes there; it may also
read the shared read-only areas the admin configures (``shared_data_areas``), and nothing else: one team's job can
never write into another team's area. Admins get no path privilege (their jobs use their own team's area), so the
worker can re-derive a job's areas from its team alone (``worker`` passes them to the engine, which re-checks every
path right before opening it). Relative paths in a spec are relative to the team's area in the first data root.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from core.settings import Settings
from engine.contract.guard import areas_env

TEAMS_DIR = "teams"
TEAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_team_name(team: str) -> str:
    """``team`` if it can name a directory (letters, digits, ``._-``, not starting with a dot); ValueError else."""
    if not TEAM_NAME.fullmatch(team):
        raise ValueError(
            f"team name {team!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit (it names the team's data directory)"
        )
    return team


def team_area(settings: Settings, team: str, root: Path | None = None) -> Path:
    """The directory ``team`` owns inside data root ``root`` (default: the first data root): ``<root>/teams/<team>``.
    Not created here (``ensure_team_areas`` does)."""
    base = (root if root is not None else settings.data_roots[0]).resolve()
    return base / TEAMS_DIR / check_team_name(team)


def shared_areas(settings: Settings) -> list[Path]:
    """The read-only areas every team may read: ``shared_data_areas`` entries, relative ones under each data root."""
    areas: list[Path] = []
    for entry in settings.shared_data_areas:
        path = Path(entry)
        areas.extend([path.resolve()] if path.is_absolute() else [(r / path).resolve() for r in settings.data_roots])
    return areas


class RootsContext(TypedDict):
    """The keyword arguments of ``engine.contract.spec.parse_spec`` that confine paths to a caller's areas."""

    data_roots: list[str]
    read_roots: list[str]


@dataclass(frozen=True)
class Areas:
    """Where one team's jobs may write (``write``, the first is the base of relative paths) and also read (``read``)."""

    write: list[Path]
    read: list[Path]

    def env(self) -> dict[str, str]:
        """The environment variables that hand these areas to the engine (``engine.contract.guard`` re-checks paths)."""
        return areas_env(self.write, self.read)

    def context(self) -> RootsContext:
        """The validation context of ``engine.contract.spec.parse_spec``."""
        return {"data_roots": [str(p) for p in self.write], "read_roots": [str(p) for p in self.read]}


def team_areas(settings: Settings, team: str) -> Areas:
    """``team``'s areas in every data root, and the shared read-only areas."""
    return Areas([team_area(settings, team, r) for r in settings.data_roots], shared_areas(settings))


def ensure_team_areas(settings: Settings, team: str) -> Areas:
    """``team_areas``, with each team area created (mode 0770) so the team's jobs and uploads can write there (a root
    this process may not write to is left as it is: its paths then simply do not exist yet)."""
    areas = team_areas(settings, team)
    for area in areas.write:
        try:
            area.mkdir(mode=0o770, parents=True, exist_ok=True)
        except OSError:
            pass
    return areas


def download_areas(settings: Settings, team: str, run_dir: Path) -> list[Path]:
    """Where a job of ``team`` may have written outputs: its team areas (as configured and resolved: the admin's links
    above them are trusted) and its run directory."""
    found = []
    for root in settings.data_roots:
        found += [team_area(settings, team, root), root.absolute() / TEAMS_DIR / check_team_name(team)]
    found += [run_dir.absolute(), run_dir.resolve()]
    return list(dict.fromkeys(found))
