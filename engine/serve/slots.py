"""A slotted KV cache for continuous batching: one preallocated row per sequence slot, each with its own length,
and a prefix index over what the slots hold.

``engine.model.kv_cache.KVCache`` keeps one fill level for the whole batch (left-padded batches decode in lockstep).
A serving batch changes every step: sequences join and leave, and each sits at its own length. ``SlotCache`` holds
the buffers of ``num_slots`` rows (allocated once, sized by the job's ``max_num_seqs`` × ``max_model_len``) and the
length of each slot; ``view`` hands the model a ``KVCache`` over some slots for one forward, where row ``i`` appends
``counts[i]`` new tokens after what its slot holds (decode steps: 1 each; prefill chunks: several, right-padded to
the longest). Every row is written in place at its own positions and read back *right-padded*: the model sees the
slots' first ``W`` columns (a slice when the slots are consecutive, else one row gather, never a shift) and a
(B, 1, T, W) boolean mask that lets query ``k`` of row ``i`` (position ``start_i + k``) see columns ``<= start_i +
k``. Keys are cached after RoPE, so where a key sits does not change it.

**Prefix caching.** Each slot also remembers the tokens whose keys/values it holds (``content``): a released slot
keeps them until it is reused (the lowest-numbered free slot first). Every full block of ``BLOCK`` tokens is indexed
by a chained hash (the block's tokens and every block before it, and the LoRA adapter they went through), so a new
prompt finds the slot holding its longest cached prefix in one dict walk; ``match`` checks the tokens themselves (a
hash collision never reuses wrong keys). The batcher then takes that slot itself when it is free (no copy) or copies
the prefix's columns from the busy slot into a free one (``copy_prefix``), and prefills only the rest: a shared
system prompt or the earlier turns of a conversation are computed once. At least one prompt token is always left to
prefill, for the first token's logits.
"""

from __future__ import annotations

import torch

from engine.contract.model_config import ModelConfig
from engine.model.kv_cache import KVCache

BLOCK = 16  # tokens per prefix-cache block (vLLM's default block size)


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
        # the lowest-numbered free slot is taken first: running rows stay consecutive and read as one slice (a
        # gather of scattered rows costs more per step than recomputing an evicted prefix once)
        self.free = list(range(num_slots))
        self.content: list[list[int]] = [[] for _ in range(num_slots)]  # tokens whose keys/values the slot holds
        self.adapter = [0] * num_slots  # the LoRA adapter the slot's keys/values went through
        self._hashes: list[list[int]] = [[] for _ in range(num_slots)]  # chained hash of each full block
        self._index: dict[int, set[int]] = {}  # block chain hash -> the slots holding that prefix

    def acquire(self, slot: int | None = None, keep: int = 0) -> int | None:
        """A free slot (``slot`` itself when given), holding its first ``keep`` positions (a cached prefix) and
        nothing after; None when all are taken."""
        if not self.free:
            return None
        slot = self.free.pop(self.free.index(min(self.free) if slot is None else slot))
        self._truncate(slot, keep)
        return slot

    def usage(self) -> float:
        """The share of the allocated positions that sequences hold now (vLLM's KV-cache usage)."""
        return sum(self.lengths) / (len(self.lengths) * self.max_len)

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.free.append(slot)

    # ------------------------------------------------------------ prefix index

    def match(self, prompt: list[int], adapter: int = 0) -> tuple[int | None, int]:
        """The slot holding the longest cached block-aligned prefix of ``prompt`` (through ``adapter``) and its
        length, leaving at least one token to prefill; (None, 0) when none is cached."""
        found: tuple[int | None, int] = (None, 0)
        chain = adapter
        for end in range(BLOCK, len(prompt), BLOCK):  # end < len(prompt): one token is always left
            chain = hash((chain, tuple(prompt[end - BLOCK : end])))
            holders = self._index.get(chain)
            if not holders:
                break
            found = (min(holders), end)
        slot, n = found
        if slot is not None and (self.adapter[slot] != adapter or self.content[slot][:n] != prompt[:n]):
            return None, 0  # a hash collision or a stale entry: never reuse keys of other tokens
        return found

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` positions of slot ``src`` into slot ``dst`` (acquired with ``keep=0``)."""
        for layer in self.keys:
            self.keys[layer][dst, :, :n] = self.keys[layer][src, :, :n]
            self.values[layer][dst, :, :n] = self.values[layer][src, :, :n]
        self.lengths[dst] = n
        self.adapter[dst] = self.adapter[src]
        for tokens in self._blocks(self.content[src][:n]):
            self._append(dst, tokens)

    def _truncate(self, slot: int, keep: int) -> None:
        """The slot keeps its first ``keep`` positions (a multiple of BLOCK) and forgets the rest."""
        blocks = keep // BLOCK
        for chain in self._hashes[slot][blocks:]:
            holders = self._index.get(chain, set())
            holders.discard(slot)
            if not holders:
                self._index.pop(chain, None)
        del self._hashes[slot][blocks:]
        del self.content[slot][keep:]
        self.lengths[slot] = keep

    def _append(self, slot: int, tokens: list[int]) -> None:
        """The slot now also holds ``tokens``' keys/values after its content; index each block it completes."""
        content = self.content[slot]
        content.extend(tokens)
        hashes = self._hashes[slot]
        while (len(hashes) + 1) * BLOCK <= len(content):
            start = len(hashes) * BLOCK
            chain = hash((hashes[-1] if hashes else self.adapter[slot], tuple(content[start : start + BLOCK])))
            hashes.append(chain)
            self._index.setdefault(chain, set()).add(slot)

    @staticmethod
    def _blocks(tokens: list[int]) -> list[list[int]]:
        return [tokens[i : i + BLOCK] for i in range(0, len(tokens), BLOCK)]

    # ------------------------------------------------------------ forwards

    def view(self, slots: list[int], counts: list[int]) -> SlotView:
        """The cache the model appends ``counts[i]`` new tokens to for slot ``slots[i]`` (see the module docstring)."""
        for s, n in zip(slots, counts, strict=True):
            if self.lengths[s] + n > self.max_len:
                raise ValueError(f"max_len: slot {s} holds {self.max_len} positions, {self.lengths[s] + n} needed")
        return SlotView(self, slots, counts)


class SlotView(KVCache):
    """The ``KVCache`` of one forward over some slots of a ``SlotCache`` (see the module docstring)."""

    def __init__(self, parent: SlotCache, slots: list[int], counts: list[int]) -> None:  # no super(): shares buffers
        self.parent, self.slots, self.counts = parent, slots, counts
        self.keys, self.values = parent.keys, parent.values
        self.max_len = parent.max_len
        self.starts = [parent.lengths[s] for s in slots]
        device = next(iter(parent.keys.values())).device
        self.new = max(counts)  # T: the batch's query columns (rows with fewer new tokens are right-padded)
        self.width = max(s + n for s, n in zip(self.starts, counts, strict=True))  # W: key columns read back
        # the real new tokens, flattened: batch row, query column, slot, cache column
        b = [i for i, n in enumerate(counts) for _ in range(n)]
        t = [k for n in counts for k in range(n)]
        self._b, self._t = torch.tensor(b, device=device), torch.tensor(t, device=device)
        slot = torch.tensor([slots[i] for i in b], device=device)
        col = torch.tensor([self.starts[i] + k for i, k in zip(b, t, strict=True)], device=device)
        _, heads, length, _ = next(iter(parent.keys.values())).shape
        # each (token, head)'s row in the buffer seen as (slots * heads * length, d): index_copy_ writes just those
        # rows (an index_put over dims 0 and 2 costs as much as touching the whole buffer)
        self._flat = (slot[:, None] * heads + torch.arange(heads, device=device)[None, :]) * length + col[:, None]
        self._flat = self._flat.reshape(-1)
        lo = slots[0]
        self._range = slice(lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else None
        self._rows = torch.tensor(slots, device=device)
        start = torch.tensor(self.starts, device=device)
        query_pos = start[:, None] + torch.arange(self.new, device=device)[None, :]  # (B, T)
        cols = torch.arange(self.width, device=device)
        self.mask = (cols[None, None, :] <= query_pos[:, :, None])[:, None]  # (B, 1, T, W)

    def positions(self) -> torch.Tensor:
        """(B, T) position ids: each row's new tokens after its slot's length (padding continues the count)."""
        start = torch.tensor(self.starts, device=self._b.device)
        return start[:, None] + torch.arange(self.new, device=self._b.device)[None, :]

    @property
    def length(self) -> int:
        """The past length the model plans attention with: the key columns before the query columns."""
        return self.width - self.new

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if len(self.slots) == 1:
            slot, start, n = self.slots[0], self.starts[0], self.counts[0]
            keys[slot, :, start : start + n] = k[0, :, :n]
            values[slot, :, start : start + n] = v[0, :, :n]
        else:
            # (B, n_kv, T, d) -> the real tokens' (N * n_kv, d), written at (slot, head, column)
            d = keys.shape[-1]
            keys.view(-1, d).index_copy_(0, self._flat, k[self._b, :, self._t].reshape(-1, d).to(keys.dtype))
            values.view(-1, d).index_copy_(0, self._flat, v[self._b, :, self._t].reshape(-1, d).to(values.dtype))
        if self._range is not None:
            return keys[self._range, :, : self.width], values[self._range, :, : self.width]
        return keys[:, :, : self.width][self._rows], values[:, :, : self.width][self._rows]

    def commit(self, tokens: list[list[int]]) -> None:
        """After the forward: each slot now holds its new tokens (``tokens[i]``, row i's real ids)."""
        for s, start, ids in zip(self.slots, self.starts, tokens, strict=True):
            self.parent.lengths[s] = start + len(ids)
            self.parent._append(s, ids)

    def reset(self) -> None:
        raise RuntimeError("reset: a slot view cannot be reset; release its slots")

    def crop(self, length: int) -> None:
        raise RuntimeError("crop: a slot view cannot be cropped")
