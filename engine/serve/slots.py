"""A slotted KV cache for continuous batching: one preallocated row per sequence slot, each with its own length.

``engine.model.kv_cache.KVCache`` keeps one fill level for the whole batch (left-padded batches decode in lockstep).
A serving batch changes every step: sequences join and leave, and each sits at its own length. ``SlotCache`` holds
the buffers of ``num_slots`` rows (allocated once, sized by the job's ``max_num_seqs`` × ``max_model_len``) and the
length of each slot; ``view`` hands the model a ``KVCache`` over some slots for one forward:

- a prefill chunk of one slot (``T`` new tokens at ``start``): written in place, attention over the slot's first
  ``start + T`` positions (a slice, no copy);
- a decode step of several slots (one new token each, each at its own length): every row is written at its own
  length, then the rows are gathered right-aligned, as a left-padded batch (``engine.eval.generate``'s layout): the
  new token in the last column, each row's past before it, and ``decode_mask`` hides the columns left of a short
  row's start. Keys are cached after RoPE, so where a key sits in the gathered batch does not change it.
"""

from __future__ import annotations

import torch

from engine.contract.model_config import ModelConfig
from engine.model.kv_cache import KVCache


class SlotCache(KVCache):
    """``num_slots`` rows of ``max_len`` positions per layer; ``lengths[s]`` is what slot ``s`` holds."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__(cfg, num_slots, max_len, dtype, device, num_kv_heads)
        self.lengths = [0] * num_slots
        self.free = list(range(num_slots))

    def acquire(self) -> int | None:
        """A free slot (emptied), or None when all are taken."""
        if not self.free:
            return None
        slot = self.free.pop(0)
        self.lengths[slot] = 0
        return slot

    def usage(self) -> float:
        """The share of the allocated positions that sequences hold now (vLLM's KV-cache usage)."""
        return sum(self.lengths) / (len(self.lengths) * self.max_len)

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.free.append(slot)

    def view(self, slots: list[int], new_tokens: int) -> SlotView:
        """The cache the model appends ``new_tokens`` to, for the rows ``slots`` (one slot when new_tokens > 1)."""
        if new_tokens > 1 and len(slots) != 1:
            raise ValueError("slots: a prefill chunk runs one slot at a time")
        for s in slots:
            if self.lengths[s] + new_tokens > self.max_len:
                raise ValueError(f"max_len: slot {s} holds {self.max_len} positions, {self.lengths[s] + new_tokens}")
        return SlotView(self, slots, new_tokens)

    def decode_mask(self, slots: list[int]) -> torch.Tensor:
        """(B, longest + 1) left-padded 1/0 mask of a decode step: row i's last ``lengths + 1`` columns are real."""
        starts = torch.tensor([self.lengths[s] for s in slots])
        width = int(starts.max()) + 1
        device = next(iter(self.keys.values())).device
        return (torch.arange(width)[None, :] >= (width - 1 - starts)[:, None]).long().to(device)


class SlotView(KVCache):
    """The ``KVCache`` of one forward over some slots of a ``SlotCache`` (see the module docstring)."""

    def __init__(self, parent: SlotCache, slots: list[int], new_tokens: int) -> None:  # no super(): shares buffers
        self.parent, self.slots, self.new_tokens = parent, slots, new_tokens
        self.keys, self.values = parent.keys, parent.values
        self.max_len = parent.max_len
        self.starts = [parent.lengths[s] for s in slots]
        device = next(iter(parent.keys.values())).device
        self._rows = torch.tensor(slots, device=device)
        self._cols = torch.tensor(self.starts, device=device)
        # gathered column j of row i holds the row's position j - (width - 1 - start_i) (clamped: masked columns)
        width = max(self.starts) + 1
        self._gather = (torch.arange(width, device=device)[None, :] - (width - 1 - self._cols)[:, None]).clamp(min=0)

    @property
    def length(self) -> int:
        """The past length the model plans attention with: the longest row's (shorter rows are masked)."""
        return max(self.starts)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if len(self.slots) == 1:
            slot, start = self.slots[0], self.starts[0]
            end = start + k.shape[2]
            keys[slot, :, start:end] = k[0]
            values[slot, :, start:end] = v[0]
            return keys[slot : slot + 1, :, :end], values[slot : slot + 1, :, :end]
        keys[self._rows, :, self._cols] = k[:, :, 0]
        values[self._rows, :, self._cols] = v[:, :, 0]
        rows = self._rows[:, None]
        # (B, width, n_kv, d) -> (B, n_kv, width, d)
        return keys[rows, :, self._gather].transpose(1, 2), values[rows, :, self._gather].transpose(1, 2)

    def commit(self) -> None:
        """After the forward: each slot now holds its new tokens."""
        for s, start in zip(self.slots, self.starts, strict=True):
            self.parent.lengths[s] = start + self.new_tokens

    def reset(self) -> None:
        raise RuntimeError("reset: a slot view cannot be reset; release its slots")

    def crop(self, length: int) -> None:
        raise RuntimeError("crop: a slot view cannot be cropped")
