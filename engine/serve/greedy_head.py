"""Greedy tokens without the full fp32 LM head: a bf16 pass over the vocabulary finds candidates, fp32 picks.

At 32 decoding rows of the demo model (hidden 512, 8 layers, Qwen3's 151,936-token vocabulary) on CPU the fp32 head
(a (V, H) x (H, B) product) and the argmax over its (B, V) logits cost more than the eight layers; a bf16 product
runs 1.5-3x faster on this CPU (half the bytes of the weight to read, AVX512-BF16). So for a plain greedy row (no
penalty, log-probabilities or grammar: ``engine.serve.batcher._plain_greedy``) the head runs in bf16, every token
whose bf16 logit lies within ``2E`` of the row's best (``E`` bounds the bf16 error of any logit) is scored again in
fp32, and the row's token is the best of those fp32 scores, provided fewer than ``CANDIDATES`` tokens lie there.
Otherwise the row takes the full fp32 head. The bf16 weight is packed once into oneDNN's blocked layout
(``_Bf16Product``): ``F.linear`` reorders a plain weight on every call, and packed the product costs ~35 % less CPU
(1 thread: 21 -> 14 ms at 1 row, 28 -> 17 ms at 32); its sums run in another order, which the bound allows (it
holds for any order of the fp32 accumulation). The candidates are found without a top-k over the vocabulary (12 ms of
CPU at 32 rows): the maxima of blocks of ``BLOCK`` tokens (one pass, ~2.5 ms), then token by token only in the
blocks whose maximum reaches the threshold.

Why it is the same token: logit ``v`` is ``y_v = w_v . h``. Rounding ``w`` and ``h`` to bf16 (unit roundoff
``u = 2^-8``, round to nearest), summing the products in fp32 (the CPU kernels accumulate bf16 products in fp32) and
rounding the result to bf16 moves it by at most ``E = ||h|| max_v ||w_v|| (2u + u^2 + 2 g (1+u)^2 + u (1+u)^2 (1+g))``
plus ``H 2^-126 (max|w| + max|h|)`` for denormals flushed to zero, with ``g = H 2^-24 / (1 - H 2^-24)`` the fp32
summation's bound (Cauchy-Schwarz: ``sum |w_i h_i| <= ||w|| ||h||``). A token outside the candidates has
``y_v <= yhat_v + E < yhat_max - E <= y_best``, so the exact argmax is a candidate; the margin also
leaves room for the fp32 head's own rounding (``g ||w|| ||h||`` on each side), so the token the full fp32 head would
pick is a candidate too, and the two can differ only where two candidates' fp32 logits are within fp32 rounding of
each other (where the full head's pick is an accident of its summation order, as it is between ours and
transformers').

A row takes the full fp32 head (the caller's ``pick_token`` path, which checks finiteness) when anything is not as
the bound assumes: a hidden state that is not finite or whose norm product could overflow, ``CANDIDATES`` or more tokens
within the margin, or a candidate score that is not finite. Only plain fp32 heads on CPU take this path: a bf16
model's head is bf16 already, GPUs' fp32 head is cheap and their bf16 products may reduce in bf16
(``allow_bf16_reduced_precision_reduction``), and a vocab-sharded (TP) head all-gathers full logits on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from engine.model.qwen3 import Qwen3Model

U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits, round to nearest even)
U_FP32 = 2.0**-24
TINY = 2.0**-126  # below it bf16/fp32 kernels may flush inputs to zero
CANDIDATES = 64  # a row with this many tokens within the margin takes the full head (its re-score would cost more)
BLOCK = 128  # tokens per block of the candidates' first pass (``_within``)


class GreedyHead:
    """The argmax of each row's fp32 logits ``weight @ h`` from a bf16 pass and an fp32 re-score of the candidates."""

    def __init__(self, weight: torch.Tensor) -> None:
        weight = weight.detach()
        hidden = weight.shape[1]
        g = hidden * U_FP32 / (1 - hidden * U_FP32)
        u = U_BF16
        self.weight = weight  # (V, H) fp32, the model's own
        self.low = _Bf16Product(weight.to(torch.bfloat16))
        self.max_norm = float(weight.norm(dim=1).max()) * (1 + 1e-4)  # rounding of the norm itself, with room
        self.max_abs = float(weight.abs().max())
        self.rel = 2 * u + u * u + 2 * g * (1 + u) ** 2 + u * (1 + u) ** 2 * (1 + g)  # bf16 error / (||w|| ||h||)
        self.ref = g  # the fp32 head's own error / (||w|| ||h||)
        self.hidden = hidden

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> GreedyHead | None:
        """The model's greedy head, or None where the full head is kept (see the module docstring)."""
        if not isinstance(model, Qwen3Model):
            return None
        weight = model.output_weight()
        if isinstance(weight, DTensor) or weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        return cls(weight)

    def margin(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B,) how far below a row's best bf16 logit a candidate may lie: ``2E`` plus the fp32 head's rounding."""
        norm = hidden.norm(dim=1) * (1 + 1e-4)
        h_abs = hidden.abs().amax(dim=1)
        err = self.rel * self.max_norm * norm + self.hidden * TINY * (self.max_abs + h_abs)
        return 2 * err + 2 * self.ref * self.max_norm * norm

    def argmax(self, hidden: torch.Tensor) -> list[int | None]:
        """hidden (B, H) fp32 at each row's last token -> each row's greedy token; None: take the full head."""
        hidden = hidden.float()
        margin = self.margin(hidden)
        # a norm product that could overflow fp32, or a non-finite state: the full head decides (and checks)
        safe = torch.isfinite(margin) & (margin * self.max_norm < 1e36)
        low = self.low(hidden.to(torch.bfloat16))  # (B, V) bf16
        rows, ids = _within(low, margin, safe)
        count = torch.bincount(rows, minlength=len(hidden))
        # a crowded top (CANDIDATES or more within the margin) takes the full head: its re-score would cost more
        crowded = count >= CANDIDATES
        keep = ~crowded[rows]
        rows, ids = rows[keep], ids[keep]
        scores = (self.weight[ids] * hidden[rows]).sum(dim=-1)  # fp32 logits of the candidates
        top = hidden.new_full((len(hidden),), -torch.inf).scatter_reduce(0, rows, scores, "amax")
        # the lowest id among equal best scores, as argmax takes
        tied = torch.where(scores == top[rows], ids, low.shape[1])
        picks = torch.full_like(count, low.shape[1]).scatter_reduce(0, rows, tied, "amin")
        finite = torch.ones_like(count).scatter_reduce(0, rows, torch.isfinite(scores).long(), "amin") > 0
        ok = safe & ~crowded & (count > 0) & finite & torch.isfinite(top)
        return [int(p) if good else None for p, good in zip(picks.tolist(), ok.tolist(), strict=True)]


class _Bf16Product:
    """``F.linear(x, weight)`` for bf16 ``x`` (B, H) and ``weight`` (V, H), the weight packed once for oneDNN where
    this build has the op (else plain ``F.linear``): fp32 accumulation of exact bf16 products either way."""

    PACKED_FOR = 32  # the batch oneDNN chooses the packing for; any batch runs on it (1 to 128 measured as fast)

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACKED_FOR)
            probe = torch.ops.mkldnn._linear_pointwise(weight[:1], packed, None, "none", [], "")
        except (AttributeError, RuntimeError):  # no oneDNN op in this build, or not for these shapes
            return
        if probe.shape == (1, weight.shape[0]) and probe.dtype == torch.bfloat16:
            self.packed, self.weight = packed, None  # the plain copy is not kept (the vocabulary's size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            assert self.weight is not None
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")


def _within(low: torch.Tensor, margin: torch.Tensor, safe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, ids): every token whose bf16 logit in ``low`` (B, V) lies within ``margin`` (B,) of its row's best,
    row by row; none for a row that is not ``safe``. The maxima of blocks of ``BLOCK`` tokens come first (one pass
    over (B, V), 5x cheaper than a top-k), then only the blocks that reach the threshold are compared token by
    token."""
    vocab = low.shape[1]
    main = vocab - vocab % BLOCK
    peaks = [low[:, :main].unflatten(1, (-1, BLOCK)).amax(dim=2)] if main else []
    if main < vocab:  # the last, shorter block
        peaks.append(low[:, main:].amax(dim=1, keepdim=True))
    peak = torch.cat(peaks, dim=1).float() if len(peaks) > 1 else peaks[0].float()  # (B, blocks); bf16 -> fp32 exact
    best = peak.amax(dim=1)
    # rounded down, never up, to fp32: no token within the margin is left out by the subtraction's rounding
    floor = torch.nextafter((best.double() - margin.double()).float(), best.new_tensor(-torch.inf))
    floor = torch.where(safe, floor, torch.inf)
    block_rows, blocks = (peak >= floor[:, None]).nonzero(as_tuple=True)
    cols = blocks[:, None] * BLOCK + torch.arange(BLOCK, device=low.device)[None, :]  # (C, BLOCK)
    inside = cols < vocab
    values = low[block_rows[:, None], cols.clamp(max=vocab - 1)].float()
    hit, at = ((values >= floor[block_rows][:, None]) & inside).nonzero(as_tuple=True)
    return block_rows[hit], cols[hit, at]
