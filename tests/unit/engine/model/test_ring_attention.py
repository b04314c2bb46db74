"""Ring attention (``engine.parallel.ring_attention``) on 2 and 4 gloo processes equals one process's attention over
the whole sequence, forward and backward: plain causal rows and packed samples, GQA, with and without the send/recv
overlap, in row tiles of a few rows. Each rank checks its own head/tail tokens' output and q/k/v gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine.parallel.ring_attention as ring_module
from engine.model.attention import AttentionPlan, block_causal_mask, core_attention, segment_starts
from engine.parallel.ring_attention import Ring, ring_attention, token_index

B, HEADS, GROUPS, T, D = 2, 4, 2, 24, 8


def _inputs(packed: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, T, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, GROUPS, T, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, GROUPS, T, D, generator=gen, dtype=torch.float64)
    weight = torch.randn(B, T, HEADS, D, generator=gen, dtype=torch.float64)  # a loss that weighs every output
    segments = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * 13 + [1] * 11]) if packed else None
    return q, k, v, weight, segments  # type: ignore[return-value]


def _reference(packed: bool) -> tuple[torch.Tensor, ...]:
    q, k, v, weight, segments = _inputs(packed)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    plan = AttentionPlan(mask=block_causal_mask(segments), is_causal=False) if segments is not None else AttentionPlan()
    out = core_attention(q, k, v, plan)
    (out * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad  # type: ignore[return-value]


def _rank(rank: int, world: int, store: str, packed: bool, overlap: bool, tile: int | None) -> None:
    if tile is not None:  # score tiles of a few rows: the tiled path at this small size
        ring_module.RING_SCORE_TILE_BYTES = tile
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ref_out, ref_dq, ref_dk, ref_dv = _reference(packed)
        q, k, v, weight, segments = _inputs(packed)
        idx = torch.from_numpy(token_index(T, world, rank))
        mine = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
        runs = None if segments is None else segment_starts(segments).cumsum(dim=1)
        ring = Ring(dist.group.WORLD, world, rank, overlap)
        out = ring_attention(*mine, ring, runs).transpose(1, 2)  # (B, t, heads, d)
        (out * weight[:, idx]).sum().backward()
        torch.testing.assert_close(out, ref_out[:, idx], rtol=1e-10, atol=1e-10)
        for got, want in zip((x.grad for x in mine), (ref_dq, ref_dk, ref_dv), strict=True):
            torch.testing.assert_close(got, want[:, :, idx], rtol=1e-10, atol=1e-10)
    finally:
        dist.destroy_process_group()


def test_token_index_is_the_causal_head_tail_split() -> None:
    assert token_index(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert token_index(16, 4, 3).tolist() == [6, 7, 8, 9]
    covered = sorted(i for r in range(4) for i in token_index(16, 4, r).tolist())
    assert covered == list(range(16))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "packed", "overlap", "tile"),
    [(2, False, True, None), (2, True, False, None), (4, True, True, 1000), (3, False, True, None)],
)
def test_ring_attention_equals_whole_sequence_attention(
    tmp_path: Path, world: int, packed: bool, overlap: bool, tile: int | None
) -> None:
    mp.spawn(_rank, args=(world, str(tmp_path / "store"), packed, overlap, tile), nprocs=world, join=True)
