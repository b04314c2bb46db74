"""The scheduler's in-memory parts against plain reference versions, over random inputs: ``fair_order`` (a heap of
team turns) yields what a scan of every team per step yields while the consumer grants, and ``FreeIndex`` places
exactly as sorting every host by (free devices, name) does, never handing out a device twice, reading each host's
device ids once and only when a placement looks at it."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from datetime import datetime, timedelta
from functools import partial
from itertools import groupby

from core.scheduler import FreeIndex, HostView, Waiting, behind_counts, fair_order
from engine.contract.spec import Resources

T0 = datetime(2026, 1, 1)


def reference_order(jobs: list[Waiting], usage: dict[str, int]) -> Iterator[Waiting]:
    """The turn rule spelled out: per priority, the team holding the fewest devices (then its oldest job) next."""
    for _priority, level in groupby(jobs, key=lambda job: job.priority):
        queues: dict[str, deque[Waiting]] = {}
        for job in level:
            queues.setdefault(job.team, deque()).append(job)
        while queues:
            team = min(queues, key=lambda t: (usage.get(t, 0), queues[t][0].created_at, queues[t][0].id))
            yield queues[team].popleft()
            if not queues[team]:
                del queues[team]


def waiting(rng: random.Random, n: int, teams: int) -> list[Waiting]:
    jobs = [
        Waiting(f"j{i:05d}", f"team{rng.randrange(teams)}", "queued", rng.choice([0, 0, 5, 10]), 0, None, None,
                T0 + timedelta(seconds=rng.randrange(n)), None)
        for i in range(n)
    ]  # fmt: skip
    return sorted(jobs, key=lambda j: (-j.priority, j.created_at, j.id))


def consume(order: Iterator[Waiting], usage: dict[str, int], rng: random.Random) -> list[str]:
    """Grant about half of the jobs as they come (the usage a pass updates), returning the order seen."""
    seen = []
    for job in order:
        seen.append(job.id)
        if rng.random() < 0.5:
            usage[job.team] = usage.get(job.team, 0) + rng.choice([1, 2, 8])
    return seen


def test_fair_order_matches_the_turn_rule_while_granting() -> None:
    for seed in range(40):
        jobs = waiting(random.Random(seed), 300, teams=1 + seed % 12)
        start = {f"team{t}": random.Random(seed).randrange(20) for t in range(6)}
        fast = consume(fair_order(jobs, dict(start)), dict(start), random.Random(seed + 1000))
        slow = consume(reference_order(jobs, dict(start)), dict(start), random.Random(seed + 1000))
        assert fast == slow, seed


def test_fair_order_lets_a_small_team_in_within_its_priority() -> None:
    backlog = [Waiting(f"r{i}", "red", "queued", 0, 0, None, None, T0 + timedelta(seconds=i), None) for i in range(50)]
    blue = Waiting("b", "blue", "queued", 0, 0, None, None, T0 + timedelta(seconds=99), None)
    usage = {"red": 4}
    assert [j.id for j in fair_order([*backlog, blue], usage)][:2] == ["b", "r0"]


def reference_place(res: Resources, hosts: list[HostView]) -> list[tuple[str, list[int]]] | None:
    free = {h.name: h.free or [] for h in hosts}
    fitting = sorted(
        (h for h in hosts if len(free[h.name]) >= res.nproc_per_node), key=lambda h: (len(free[h.name]), h.name)
    )
    if len(fitting) < res.nnodes:
        return None
    return [(h.name, free[h.name][: res.nproc_per_node]) for h in fitting[: res.nnodes]]


def read_ids(truth: dict[str, list[int]], loaded: list[str], batch: list[HostView]) -> None:
    """``core.scheduler.free_ids`` over ``truth`` (the leases in the database), counting each host read."""
    for view in batch:
        assert view.free is None, "a host's ids are read once"
        view.free = list(truth[view.name])
        loaded.append(view.name)


def test_free_index_places_best_fit_like_a_full_sort_and_never_twice() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        names = sorted(f"h{i:03d}" for i in range(rng.randrange(1, 60)))
        truth = {n: sorted(rng.sample(range(8), rng.randrange(9))) for n in names}  # the leases in the database
        hosts = [HostView(n, "a", len(truth[n]), 8) for n in names]  # counts only: ids read when looked at
        mirror = [HostView(n, "a", len(truth[n]), 8, list(truth[n])) for n in names]
        loaded: list[str] = []

        index, taken = FreeIndex(hosts, partial(read_ids, truth, loaded)), set()
        for _ in range(200):
            res = Resources(nnodes=rng.choice([1, 1, 2, 4]), nproc_per_node=rng.choice([1, 2, 4, 8]))
            want = reference_place(res, mirror)
            placement = index.place(res)
            assert (want is None) == (placement is None)
            if placement is None:
                continue
            assert [(h.name, d) for h, d in placement] == want
            index.take(placement)
            for host, devices in placement:
                for d in devices:
                    assert (host.name, d) not in taken
                    taken.add((host.name, d))
                view = next(m for m in mirror if m.name == host.name)
                view.free = [d for d in view.free or [] if d not in devices]
            assert sorted(h.free_count for h in hosts) == sorted(len(m.free or []) for m in mirror)
        assert len(loaded) == len(set(loaded))


def test_behind_counts_follow_priority_then_age_per_device_type() -> None:
    jobs = waiting(random.Random(3), 12, teams=3)
    behind = {j.id: ("cpu" if i % 3 else "cuda") for i, j in enumerate(jobs) if i % 4}
    counts = behind_counts(jobs, behind)
    for kind in ("cpu", "cuda"):
        mine = [j.id for j in jobs if behind.get(j.id) == kind]
        assert [counts[i] for i in mine] == list(range(1, len(mine) + 1))  # the blocked job, then those before
