"""The two sides of a side-by-side benchmark, run pair by pair (a helper of ``bench/``, not a benchmark).

On a shared machine the load changes within minutes: with each side in one block, ``bench/train_step.py`` gave 3.87×
and then 1.42× twenty minutes apart, because one side ran under a different load than the other. Here each pair runs
both sides one right after the other (A B, then B A, so neither side always runs second), each pair's ratio compares
runs made under about the same load, and the figure is the median of the pairwise ratios, reported with its spread
(min, max) and the number of pairs.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def alternate(
    run: Callable[[str], T], sides: tuple[str, str], pairs: int, log: Callable[[T], None] = print
) -> list[dict[str, T]]:
    """``run(side)`` for both sides in each of ``pairs`` pairs, the order flipped every pair; each result is logged."""
    rounds = []
    for number in range(pairs):
        results = {}
        for side in sides if number % 2 == 0 else sides[::-1]:
            results[side] = run(side)
            log(results[side])
        rounds.append(results)
    return rounds


def add_step_pair_flags(parser: argparse.ArgumentParser, *, rival: str, repeats: int, smoke: str) -> None:
    """The flags every training-step bench of ours against ``rival`` (train_step, dpo_step, grpo_step) takes, each
    with one meaning: timed steps and pairs of fresh processes, the seed, each side's threads, and ``--smoke``."""
    parser.add_argument("--repeats", type=int, default=repeats, help="timed steps per process, after one warm-up step")
    parser.add_argument(
        "--pairs", type=int, default=3, help=f"pairs of fresh processes, ours and {rival}'s (A B, B A, ...)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per side; 1 keeps a shared machine's other load from making every op "
        "wait for its slowest thread (many small ops suffer more than a few large GEMMs)",
    )
    parser.add_argument("--smoke", action="store_true", help=smoke)


def pair_ratios(name: str, ratios: list[float], digits: int = 3) -> dict[str, float | int]:
    """``{name: median, name_min, name_max, name_pairs}`` of one ratio per pair."""
    return {
        name: round(statistics.median(ratios), digits),
        f"{name}_min": round(min(ratios), digits),
        f"{name}_max": round(max(ratios), digits),
        f"{name}_pairs": len(ratios),
    }


def speed_and_memory(
    rounds: list[dict[str, dict[str, Any]]], baseline: str, tokens_per_s: Callable[[dict[str, Any]], float]
) -> dict[str, Any]:
    """A training bench's figures, ours against ``baseline`` (each side's result holds ``peak_mem_mb``;
    ``tokens_per_s`` reads its speed): the pairwise tokens/s and peak-memory ratios, and each side's figures."""
    tps = [{side: tokens_per_s(r) for side, r in pair.items()} for pair in rounds]
    peaks = [{side: r["peak_mem_mb"] for side, r in pair.items()} for pair in rounds]
    return {
        **pair_ratios("tokens_per_s_ratio", [t["ours"] / t[baseline] for t in tps]),
        **pair_ratios("peak_mem_ratio", [p["ours"] / p[baseline] for p in peaks]),
        "ours_tokens_per_s": [round(t["ours"], 1) for t in tps],
        f"{baseline}_tokens_per_s": [round(t[baseline], 1) for t in tps],
        "ours_peak_mem_mb": [round(p["ours"], 1) for p in peaks],
        f"{baseline}_peak_mem_mb": [round(p[baseline], 1) for p in peaks],
    }
