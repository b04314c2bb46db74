"""Per-team counts of long requests held open on this API replica (SSE streams, uploads), refused with 429 past a limit.

A count lives in the replica's memory: the limit bounds what one team can hold of one process (its threads, sockets and
file handles), which is what a flood exhausts; N replicas admit up to N times the limit in all.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from core.errors import team_limit_reached


class TeamSlots:
    def __init__(self, what: str, limit: int, retry_after_s: int):
        self.what, self.limit, self.retry_after_s = what, limit, retry_after_s
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()  # sync routes run in worker threads

    def acquire(self, team: str) -> None:
        """Take one of ``team``'s slots, or raise 429 ``too_many_requests`` with Retry-After (limit 0: no limit)."""
        with self._lock:
            held = self._held.get(team, 0)
            if self.limit and held >= self.limit:
                message = f"team {team} has {held} {self.what} open, its limit; close one or retry later"
                raise team_limit_reached("too_many_requests", message, self.retry_after_s)
            self._held[team] = held + 1

    def release(self, team: str) -> None:
        with self._lock:
            held = self._held.get(team, 0) - 1
            if held > 0:
                self._held[team] = held
            else:
                self._held.pop(team, None)

    @contextmanager
    def hold(self, team: str) -> Iterator[None]:
        self.acquire(team)
        try:
            yield
        finally:
            self.release(team)
