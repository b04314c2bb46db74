"""The language-model head over the last position of each row, as decoding needs it (eval's generation, serving):
whole-vocabulary fp32 logits on every rank, the head's vocab shards all-gathered under TP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from engine.model.decoder_lm import decoder_lm


def _head(last: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(B, H) x (V, H) -> (B, V) fp32 logits."""
    if last.device.type == "cpu":
        # W @ h^T: MKL runs this (V x H) x (H x B) product ~3x faster than h @ W^T when B is a handful of rows
        # (measured: 93 vs 304 ms for V=151936, H=256, B=8 on 2 threads); GPUs do not care.
        return torch.mm(weight, last.t()).t().float()
    return F.linear(last, weight).float()


def last_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """(B, T, H) -> (B, V) for the last position only; under TP every rank gets the full (B, V) logits."""
    last = hidden[:, -1]  # (B, H)
    weight = decoder_lm(model).output_weight()  # (V, H), or a vocab-sharded DTensor (V/TP local rows) under TP
    if not isinstance(weight, DTensor):
        return _head(last, weight)
    # Vocab-parallel head: local (B, V/TP) logits, all-gathered on the vocab dim so that sampling sees the
    # whole vocabulary and every TP rank picks the same token (the same seed drives every rank's generator).
    local = _head(last, weight.to_local())
    return DTensor.from_local(local, weight.device_mesh, [Shard(-1)], run_check=False).full_tensor()
