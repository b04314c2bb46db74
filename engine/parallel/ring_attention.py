"""Ring attention (Megatron-LM's context parallelism; MindSpeed's ``megatron_cp_algo``): each of the CP ranks of a
sequence keeps its own queries and passes its keys and values around the ring, one block per step, merging each
block's partial softmax by its log-sum-exp. The backward pass goes round the ring once more, the K/V gradients of each
block travelling with the block and arriving home at the end. Nothing of the whole sequence is ever on one rank.

Causal load balance (Megatron's head/tail split): the sequence is cut into ``2 × CP`` chunks and rank ``r`` holds
chunks ``r`` and ``2·CP − 1 − r`` (``token_index``), so every rank does the same work. Its tokens are in increasing
position order, so a block's useful part is one or two rectangles: of a block from an earlier rank every query sees
only its first chunk, of a later rank only the second query chunk sees anything, and on the diagonal the head chunk
sees only itself (``_useful``). Those parts are all that is computed, forward and backward.

Without packed samples every useful part of a block is either seen whole or the same positions on both sides
(causal), and on CPU SDPA's fused kernel computes it with its log-sum-exp, forward and backward (the backward given
the merged output and log-sum-exp, as flash attention's ring users do), in fp32 (fp64 stays fp64) and without a
score buffer. Packed samples, and other devices, take the plain-torch block (scores in fp32, the same arithmetic as
a math kernel) in row tiles of at most ``RING_SCORE_TILE_BYTES`` so its transient buffers do not grow with the
sequence (what ``npu_fusion_attention``'s softmax outputs would replace on Ascend). Packed samples mask by their run
index (``AttentionPlan.runs``), never by a (T, T) mask: at 128K tokens that would be 16 GB.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from engine.contract.constants import RING_SCORE_TILE_BYTES


def token_index(width: int, cp: int, rank: int) -> np.ndarray:
    """Positions (in the padded row of ``width`` tokens, a multiple of ``2 × cp``) that ring rank ``rank`` holds:
    chunk ``rank`` then chunk ``2·cp − 1 − rank``."""
    c = width // (2 * cp)
    return np.concatenate(
        [np.arange(rank * c, (rank + 1) * c), np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    )


@dataclasses.dataclass(frozen=True)
class Ring:
    """One rank's place on the ring."""

    group: ProcessGroup
    size: int
    rank: int
    overlap: bool = True  # use_cp_send_recv_overlap: the next block travels while this one is computed

    @property
    def next(self) -> int:
        return dist.get_global_rank(self.group, (self.rank + 1) % self.size)

    @property
    def prev(self) -> int:
        return dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def index(self, local: int, rank: int | None = None) -> np.ndarray:
        """Global positions of the ``local`` tokens ``rank`` (default this one) holds (on the host: which part of
        a block is useful is then decided without a device sync)."""
        return token_index(local * self.size, self.size, self.rank if rank is None else rank)

    def shift(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """Start sending ``tensors`` to the next rank and receiving the previous rank's into new buffers."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        reqs = dist.batch_isend_irecv(ops)
        if not self.overlap:
            for req in reqs:
                req.wait()
            reqs = []
        return received, reqs


def _useful(q_idx: np.ndarray, k_idx: np.ndarray) -> list[tuple[slice, slice]]:
    """The (query rows, key columns) rectangles of a block that causality leaves anything to: per query chunk (a
    rank's head and tail chunks, each sorted), its rows from the first that sees the block's first key, and the keys
    up to its last query. On the diagonal this skips the head chunk's view of the tail chunk, a quarter of the block;
    two rectangles over the same keys are one."""
    half = len(q_idx) // 2
    rects: list[tuple[slice, slice]] = []
    for start, stop in ((0, half), (half, len(q_idx))):
        lo = start + int(np.searchsorted(q_idx[start:stop], k_idx[0]))
        hi = int(np.searchsorted(k_idx, q_idx[stop - 1], side="right"))
        if lo < stop and hi > 0:
            if rects and rects[-1][1].stop == hi and rects[-1][0].stop == lo:
                rects[-1] = (slice(rects[-1][0].start, stop), rects[-1][1])
            else:
                rects.append((slice(lo, stop), slice(0, hi)))
    return rects


def _tiles(rows: slice, row_bytes: int) -> list[slice]:
    """``rows`` cut into tiles of at most ``RING_SCORE_TILE_BYTES`` of scores, so a block's transient buffers stay
    bounded whatever the sequence length."""
    step = max(1, RING_SCORE_TILE_BYTES // max(1, row_bytes))
    return [slice(r, min(r + step, rows.stop)) for r in range(rows.start, rows.stop, step)]


def _parts(
    rows: slice,
    cols: slice,
    q_idx: np.ndarray,
    k_idx: np.ndarray,
    runs: torch.Tensor | None,
    row_bytes: int,
    device: torch.device,
) -> list[tuple[slice, slice, bool | None]]:
    """A useful rectangle as (rows, cols, causal) parts. On CPU without packed samples, every part is either seen
    whole (``False``) or the same positions on both sides (``True``, top-left causal), which SDPA's fused CPU kernel
    computes with its log-sum-exp and no score buffer: the rectangle whole when every key precedes every query, else
    cut where the keys' positions jump (a rank's head and tail chunks). Otherwise (packed samples, other devices)
    row tiles of at most ``RING_SCORE_TILE_BYTES`` of scores with ``causal`` None: the masked plain-torch block."""
    q_pos, k_pos = q_idx[rows], k_idx[cols]
    if device.type == "cpu" and runs is None:
        if k_pos[-1] <= q_pos[0]:
            return [(rows, cols, False)]
        cuts = [cols.start, *(cols.start + 1 + np.flatnonzero(np.diff(k_pos) != 1)).tolist(), cols.stop]
        parts = [slice(a, b) for a, b in itertools.pairwise(cuts)]
        if all(k_idx[c][-1] <= q_pos[0] or np.array_equal(k_idx[c], q_pos) for c in parts):
            return [(rows, c, not k_idx[c][-1] <= q_pos[0]) for c in parts]
    return [(r, cols, None) for r in _tiles(rows, row_bytes * len(k_pos))]


def _fused_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_block_forward`` of a part every query row sees something of, by SDPA's fused CPU kernel (fp32 or fp64)."""
    heads = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _acc(q), _acc(_expand(k, heads)), _acc(_expand(v, heads)), 0.0, causal, scale=scale
    )
    return out, lse


def _mask(q_pos: np.ndarray, k_pos: np.ndarray, runs: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(B or 1, 1, tq, tk) bool: causal, and within one packed sample when ``runs`` (B, T) is given."""
    q_idx, k_idx = torch.from_numpy(q_pos).to(device), torch.from_numpy(k_pos).to(device)
    allowed = (k_idx[None, :] <= q_idx[:, None])[None, None]
    if runs is not None:
        same = runs[:, q_idx][:, :, None] == runs[:, k_idx][:, None, :]
        allowed = allowed & same[:, None]
    return allowed


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum a (B, heads, T, d) gradient of expanded K/V back over each group's query heads."""
    b, h, t, d = grad.shape
    return grad if h == groups else grad.view(b, groups, h // groups, t, d).sum(2)


def _acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the accumulation dtype: fp32 for bf16/fp16/fp32 inputs (as flash kernels), fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    s = torch.matmul(_acc(q), _acc(k).transpose(-1, -2)) * scale
    return s.masked_fill(~mask, float("-inf"))


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ) v of one block and its log-sum-exp (−inf for rows that see nothing; their output is 0)."""
    s = _scores(q, _expand(k, q.shape[1]), mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.matmul(p, _acc(_expand(v, q.shape[1]))), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor, rows: slice) -> None:
    """Fold a block's (o, l) over query ``rows`` into the running (out, lse), in place."""
    old = lse[..., rows]
    new = torch.logaddexp(old, l)
    new_safe = torch.where(torch.isinf(new), 0.0, new)
    out[..., rows, :] = (
        out[..., rows, :] * torch.exp(old - new_safe)[..., None] + o * torch.exp(l - new_safe)[..., None]
    )
    lse[..., rows] = new


class _RingAttention(torch.autograd.Function):
    # ctx: Any (forward, backward): autograd's context, carrying what forward saves for backward (torch types it so)
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, runs: torch.Tensor | None
    ) -> torch.Tensor:
        """q (B, heads, t, d), k/v (B, groups, t, d), this rank's tokens -> (B, heads, t, d)."""
        with torch.autocast(q.device.type, enabled=False):  # the blocks accumulate in fp32, not autocast's bf16
            out, lse = _ring_forward(q, k, v, ring, runs)
        ctx.save_for_backward(q, k, v, out, lse, runs)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, runs = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            return (*_ring_backward(dout, q, k, v, out, lse, runs, ctx.ring), None, None)


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, runs: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = q.shape[-1] ** -0.5
    b, h, t, d = q.shape
    q_idx = ring.index(t)
    acc = _acc(q).dtype
    out = torch.zeros(b, h, t, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, t), float("-inf"), dtype=acc, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    for step in range(ring.size):
        pending = ring.shift(kv) if step < ring.size - 1 else None
        k_idx = ring.index(t, (ring.rank - step) % ring.size)
        for block_rows, block_cols in _useful(q_idx, k_idx):
            for rows, cols, causal in _parts(block_rows, block_cols, q_idx, k_idx, runs, b * h * 4, q.device):
                kc, vc = (x[..., cols, :] for x in kv)
                if causal is None:
                    mask = _mask(q_idx[rows], k_idx[cols], runs, q.device)
                    o, l = _block_forward(q[..., rows, :], kc, vc, mask, scale)
                else:
                    o, l = _fused_forward(q[..., rows, :], kc, vc, causal, scale)
                _merge(out, lse, o, l, rows)
        if pending is not None:
            for req in pending[1]:
                req.wait()
            kv = pending[0]
    return out.to(q.dtype), lse


def _ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    runs: torch.Tensor | None,
    ring: Ring,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scale = q.shape[-1] ** -0.5
    t, heads, groups = q.shape[2], q.shape[1], k.shape[1]
    q_idx = ring.index(t)
    dout32, q32, out32 = _acc(dout), _acc(q), _acc(out)
    delta = (dout32 * out32).sum(-1)  # (B, heads, t): rowsum(dO ∘ O)
    dq = torch.zeros_like(q32)
    kv = [k.contiguous(), v.contiguous()]
    dkv = [torch.zeros(k.shape, dtype=q32.dtype, device=k.device) for _ in range(2)]
    for step in range(ring.size):
        pending = ring.shift(kv) if step < ring.size - 1 else None
        k_idx = ring.index(t, (ring.rank - step) % ring.size)
        for block_rows, block_cols in _useful(q_idx, k_idx):
            parts = _parts(block_rows, block_cols, q_idx, k_idx, runs, q.shape[0] * heads * 4, q.device)
            for rows, cols, causal in parts:
                kc, vc = (_acc(_expand(x[..., cols, :], heads)) for x in kv)
                if causal is not None:
                    dq_, dk_, dv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        dout32[..., rows, :], q32[..., rows, :], kc, vc, out32[..., rows, :], lse[..., rows],
                        0.0, causal, scale=scale,
                    )  # fmt: skip
                else:
                    s = _scores(q32[..., rows, :], kc, _mask(q_idx[rows], k_idx[cols], runs, q.device), scale)
                    p = torch.exp(s - lse[..., rows, None])  # lse is finite: every query sees itself
                    d_rows = dout32[..., rows, :]
                    ds = p * (torch.matmul(d_rows, vc.transpose(-1, -2)) - delta[..., rows, None])
                    dq_, dk_ = (
                        torch.matmul(ds, kc) * scale,
                        torch.matmul(ds.transpose(-1, -2), q32[..., rows, :]) * scale,
                    )
                    dv_ = torch.matmul(p.transpose(-1, -2), d_rows)
                dq[..., rows, :] += dq_
                dkv[0][..., cols, :] += _fold(dk_, groups)
                dkv[1][..., cols, :] += _fold(dv_, groups)
        # the block's gradients go on with it; after the last step they arrive at the block's own rank
        sent, reqs = ring.shift(dkv)
        for req in reqs + (pending[1] if pending is not None else []):
            req.wait()
        dkv = sent
        if pending is not None:
            kv = pending[0]
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, runs: torch.Tensor | None
) -> torch.Tensor:
    """Attention of this rank's queries over the whole ring's keys: q (B, heads, t, d), k/v (B, groups, t, d), this
    rank's ``t`` tokens in ``token_index`` order; ``runs`` (B, T) the packed-sample index of every token of the
    whole sequence, or None for plain causal rows. Returns (B, heads, t, d)."""
    if ring.size == 1:
        raise ValueError("ring attention needs more than one rank")
    out = _RingAttention.apply(q, k, v, ring, runs)
    assert isinstance(out, torch.Tensor)
    return out
