"""A finished node whose outcome the database did not take within ``database_away_deadline_s``: its exit is parked
as a file in the run directory instead of being lost with the task. The worker's heartbeat
(``worker.node.finish_parked``) stores it once the database answers; until then the lease sweep
(``worker.leases.sweep_host``) leaves the node alone instead of taking it for lost.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.contract.runfiles import RunDir


@dataclass(frozen=True)
class ParkedExit:
    attempt: int
    node_rank: int
    code: int
    stop: str | None
    offsets: dict[str, int] | None = None  # node 0's ingest offsets: the final ingest resumes there
    last_error: dict[str, Any] | None = None  # the engine's last error event, for the failure message


def parked_path(run_dir: Path, attempt: int, node_rank: int) -> Path:
    return run_dir / f"parked-exit-attempt{attempt}-node{node_rank}.json"


def park(run_dir: Path, parked: ParkedExit) -> Path:
    """Write ``parked`` atomically (a crash never leaves half a file)."""
    return RunDir(run_dir).write_json(parked_path(run_dir, parked.attempt, parked.node_rank).name, asdict(parked))


def read_parked(run_dir: Path, attempt: int, node_rank: int) -> ParkedExit | None:
    path = parked_path(run_dir, attempt, node_rank)
    return ParkedExit(**json.loads(path.read_text())) if path.is_file() else None


def unpark(run_dir: Path, attempt: int, node_rank: int) -> None:
    parked_path(run_dir, attempt, node_rank).unlink(missing_ok=True)
