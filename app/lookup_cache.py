"""A short memory of the OpenAI routes' two database look-ups per request: team token -> principal
(``app.auth_first``) and (team, ``model``) -> ready deployment (``app.api.openai_compat``).

Each look-up is a few ms of CPU in a worker thread; with many requests arriving together on a busy CPU they queued
behind one another and added ~0.1-0.2 s to the time to first token (``bench/serve_api_path.py``).

Bounds (what keeps it safe):
- An entry lives ``TTL_S`` seconds at most, and each cache holds ``MAX_ENTRIES`` (oldest dropped first).
- Only hits are kept: an unknown or revoked token, a missing or not-ready deployment is looked up every time, so a new
  token or a deployment that just became ready works at once.
- A write in this process to the rows they come from (``api_tokens``; ``jobs``, ``events``: a cancel, a new attempt,
  an adapter loaded) clears the matching cache when flushed and again when committed (SQLAlchemy session events), so
  a revoke or stop through this process takes effect on the next request. A look-up that began before a clear does
  not store its (maybe stale) answer.
- A write by another process (the ``token revoke`` CLI, the worker stopping an engine) takes effect within ``TTL_S``;
  a remembered deployment whose engine refuses or answers 404 is forgotten and looked up again at once
  (``openai_compat._on_deployment``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from itertools import chain
from typing import Any, Generic, TypeVar

import anyio
from sqlalchemy import event
from sqlalchemy.orm import ORMExecuteState, Session

from core.auth import Principal, hash_token
from core.deployments import Deployment
from core.models import ApiToken, Event, Job

TTL_S = 5.0
MAX_ENTRIES = 1024
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    """Entries that expire ``ttl_s`` after they were stored (read at each get); at most ``max_entries``. Thread-safe:
    it is cleared from the worker threads that write the database."""

    def __init__(self, ttl_s: float, max_entries: int):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()  # key -> (stored at, value)
        self._lock = threading.Lock()
        self.generation = 0  # bumped by clear: an answer looked up before it is not stored
        self._pending: dict[K, anyio.Event] = {}  # keys being looked up (on the event loop only)

    def get(self, key: K) -> V | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None or found[0] + self.ttl_s <= time.monotonic():
                self._entries.pop(key, None)
                return None
            return found[1]

    def put(self, key: K, value: V, generation: int) -> None:
        with self._lock:
            if generation != self.generation:
                return
            self._entries[key] = (time.monotonic(), value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def discard(self, key: K) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.generation += 1

    async def remembered(
        self, key: K, lookup: Callable[[], V | None], keep: Callable[[V], bool] = lambda _: True
    ) -> tuple[V | None, bool]:
        """(the value, True) when remembered; else (``lookup()`` run in a worker thread, False), stored when found
        and ``keep`` accepts it. Requests that miss together wait for the first one's look-up (a burst after expiry
        is one look-up, not one per request) and look up themselves only when it stored nothing."""
        waited = self._pending.get(key)
        if waited is not None:
            await waited.wait()
        hit = self.get(key)
        if hit is not None:
            return hit, True
        generation, owned = self.generation, waited is None  # the first to miss: the others wait for its look-up
        if owned:
            self._pending[key] = anyio.Event()
        try:
            value = await anyio.to_thread.run_sync(lookup)
            if value is not None and keep(value):
                self.put(key, value, generation)
        finally:
            if owned:
                self._pending.pop(key).set()
        return value, False


PRINCIPALS: TTLCache[tuple[str, str], Principal] = TTLCache(TTL_S, MAX_ENTRIES)
DEPLOYMENTS: TTLCache[tuple[str, str, bool, str], Deployment] = TTLCache(TTL_S, MAX_ENTRIES)
_SOURCES: dict[type, TTLCache[Any, Any]] = {ApiToken: PRINCIPALS, Job: DEPLOYMENTS, Event: DEPLOYMENTS}


def principal_key(database_url: str, token: str) -> tuple[str, str]:
    return database_url, hash_token(token)  # the secret itself is not kept


def deployment_key(database_url: str, principal: Principal, model: str) -> tuple[str, str, bool, str]:
    return database_url, principal.team, principal.admin, model  # an admin sees every team's deployments


def _written(session: Session, kinds: Any) -> None:
    for cache in {_SOURCES[k] for k in kinds if k in _SOURCES}:
        cache.clear()
        session.info.setdefault("lookup_caches", set()).add(id(cache))


@event.listens_for(Session, "do_orm_execute")
def _on_execute(state: ORMExecuteState) -> None:
    if not state.is_select and state.bind_mapper is not None:  # update(ApiToken), update(Job), delete(...)
        _written(state.session, [state.bind_mapper.class_])


@event.listens_for(Session, "after_flush")
def _on_flush(session: Session, _context: Any) -> None:
    _written(session, {type(o) for o in chain(session.new, session.dirty, session.deleted)})


@event.listens_for(Session, "after_commit")
def _on_commit(session: Session) -> None:
    """Cleared again once the write is visible: a look-up between the flush and the commit read the old rows."""
    for cache in {c for c in _SOURCES.values() if id(c) in session.info.pop("lookup_caches", ())}:
        cache.clear()


@event.listens_for(Session, "after_rollback")
def _on_rollback(session: Session) -> None:
    session.info.pop("lookup_caches", None)
