"""Over-long samples: MindSpeed's proportional truncation of prompt/answer pairs, head truncation, or dropping.

A rendered sample is a sequence of (source, target) pairs: each maximal run of masked tokens (system, user turn,
assistant header, a masked empty thought) followed by the trained run after it (the assistant turn). MindSpeed cuts
every pair so that the whole sample fits, turn by turn (``Template._make_pairs`` in
``mindspeed_llm/tasks/preprocess/templates.py``); later turns that no longer fit are left out:

- ``qwen3`` (``LFDefaultTemplate`` / ``ReasoningTemplate``): budget ``seq_length - 1``; each pair gets
  ``_infer_seqlen(source, target, budget - used)`` (``mindspeed_llm/tasks/preprocess/decoder_packed_mtf_dataset.py``):
  a short target is kept whole, else a short source is kept whole, else both shrink in proportion.
  ``hf`` uses the same rule (MindSpeed has no such template; this is the closest).
- ``qwen`` (the older ``Template`` class): budget ``seq_length``; each pair gets ``infer_max_len(source, target,
  budget - used, reserved_label_len=1)`` (same file), so a cut sample can come out at exactly ``seq_length``
  tokens and is then dropped by the writer's check below.

After that the writer drops every sample of ``seq_length`` tokens or more (``data_handler.py``
``_serialize_to_disk``: ``len(sentence) >= seq_length``), which is also why, with ``--append-eod``, a sample cut to
``seq_length - 1`` tokens is dropped once its end-of-document token is added: MindSpeed does exactly that.
MindSpeed's own code cannot be imported here (it needs torch_npu/Megatron at import), hence these few lines.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from engine.contract.constants import IGNORE_INDEX

POLICIES = ("truncate", "truncate_head", "drop")


def pairs_of(labels: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start, source_end, target_end)`` of each masked run and the trained run after it."""
    trained = labels != IGNORE_INDEX
    edges = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), labels.size]
    runs = list(pairwise(bounds))
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(runs):
        start, end = runs[i]
        if trained[start]:  # a trained run with no source before it (only at the very start)
            out.append((start, start, end))
            i += 1
        elif i + 1 < len(runs):
            out.append((start, end, runs[i + 1][1]))
            i += 2
        else:  # trailing masked tokens with no answer after them
            out.append((start, end, end))
            i += 1
    return out


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """MindSpeed ``_infer_seqlen`` (``decoder_packed_mtf_dataset.py``): new (source, target) lengths."""
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def infer_max_len(source_len: int, target_len: int, max_len: int, reserved_label_len: int = 1) -> tuple[int, int]:
    """MindSpeed ``infer_max_len`` (``templates.py``, used by the ``qwen`` template): max (source, target) lengths."""
    max_target_len = 0 if source_len + target_len == 0 else int(max_len * (target_len / (source_len + target_len)))
    max_target_len = max(max_target_len, reserved_label_len)
    return max_len - min(max_target_len, target_len), max_target_len


def truncate_pairs(
    ids: np.ndarray, labels: np.ndarray, seq_length: int, template: str
) -> tuple[np.ndarray, np.ndarray]:
    """Cut every (source, target) pair as MindSpeed's ``template`` does for ``--seq-length seq_length``."""
    older = template == "qwen"
    cutoff = seq_length if older else seq_length - 1
    keep: list[np.ndarray] = []
    used = 0
    for start, mid, end in pairs_of(labels):
        if used >= cutoff:
            break
        fit = infer_max_len if older else infer_seqlen
        max_source, max_target = fit(mid - start, end - mid, cutoff - used)
        source = np.arange(start, mid)[:max_source]
        target = np.arange(mid, end)[:max_target]
        keep += [source, target]
        used += source.size + target.size
    index = np.concatenate(keep) if keep else np.zeros(0, np.int64)
    return ids[index], labels[index]


def limit_sample(
    ids: np.ndarray, labels: np.ndarray, seq_length: int | None, policy: str, template: str, eod: int | None
) -> tuple[np.ndarray, np.ndarray, str | None]:
    """Apply ``policy`` and ``--append-eod``; returns (ids, labels, outcome): outcome None (kept as is),
    ``"truncated"`` or a drop reason (``"too_long"``; the caller drops the sample)."""
    outcome = None
    extra = 0 if eod is None else 1
    if seq_length is not None:
        size = ids.size
        if policy == "truncate":  # MindSpeed runs its pair cut on every sample; it changes only what does not fit
            ids, labels = truncate_pairs(ids, labels, seq_length, template)
        elif ids.size + extra >= seq_length:
            if policy == "drop":
                return ids, labels, "too_long"
            ids, labels = ids[: seq_length - 1 - extra], labels[: seq_length - 1 - extra]
        outcome = "truncated" if ids.size < size else None
    if eod is not None:
        ids = np.append(ids, np.int32(eod)).astype(np.int32)
        labels = np.append(labels, np.int32(eod)).astype(np.int32)
    if seq_length is not None and ids.size >= seq_length:
        return ids, labels, "too_long"
    return ids, labels, outcome
