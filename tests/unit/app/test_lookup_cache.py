"""``app.lookup_cache.TTLCache`` on its own: a burst of misses is one look-up, a look-up that a clear overtook is not
stored, entries expire and the oldest go past the bound. (Its invalidation by revokes and cancels through the routes:
``test_openai_routes.test_remembered_token_and_deployment_follow_revokes_and_stops``.)"""

from __future__ import annotations

import threading
import time

import anyio

from app.lookup_cache import TTLCache


def test_a_burst_of_misses_is_one_lookup_and_misses_are_not_kept() -> None:
    cache: TTLCache[str, int] = TTLCache(60.0, 8)
    calls: list[str] = []

    def lookup(value: int | None) -> int | None:
        calls.append("x")
        time.sleep(0.05)
        return value

    async def burst(value: int | None) -> list[tuple[int | None, bool]]:
        got: list[tuple[int | None, bool]] = []

        async def one() -> None:
            got.append(await cache.remembered("k" if value else "none", lambda: lookup(value)))

        async with anyio.create_task_group() as group:
            for _ in range(6):
                group.start_soon(one)
        return got

    assert sorted(anyio.run(burst, 7)) == [(7, False)] + [(7, True)] * 5 and len(calls) == 1
    calls.clear()
    assert anyio.run(burst, None) == [(None, False)] * 6 and len(calls) == 6  # nothing found: each asks itself


def test_a_lookup_overtaken_by_a_clear_is_not_stored() -> None:
    cache: TTLCache[str, int] = TTLCache(60.0, 8)
    started, cleared = threading.Event(), threading.Event()

    def lookup() -> int:
        started.set()
        cleared.wait(5)
        return 1  # read before the write that cleared the cache

    async def main() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(cache.remembered, "k", lookup)
            await anyio.to_thread.run_sync(started.wait)
            cache.clear()
            cleared.set()
        assert cache.get("k") is None
        assert await cache.remembered("k", lambda: 2) == (2, False) and cache.get("k") == 2

    anyio.run(main)


def test_entries_expire_and_the_oldest_go_first() -> None:
    cache: TTLCache[int, int] = TTLCache(60.0, 2)
    for k in range(3):
        cache.put(k, k, cache.generation)
    assert [cache.get(k) for k in range(3)] == [None, 1, 2]
    cache.ttl_s = 0.0
    assert cache.get(2) is None
