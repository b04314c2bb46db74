"""A slotted KV cache for continuous batching: one preallocated row per sequence slot, each with its own length,
and a prefix index over what the slots hold.

``engine.model.kv_cache.KVCache`` keeps one fill level for the whole batch (left-padded batches decode in lockstep).
A serving batch changes every step: sequences join and leave, and each sits at its own length. ``SlotCache`` holds
the buffers of the job's ``max_num_seqs`` rows of ``max_model_len`` positions (allocated once) and the length of each
slot; ``view`` hands the model a ``KVCache`` over some slots for ONE forward that carries prompt
chunks and decode tokens together, as vLLM's chunked prefill does: row ``i`` appends ``counts[i]`` new tokens after
what its slot holds, and every row's tokens are flattened into one (1, N) batch with per-token positions, so the
linear layers see N real tokens and no padding. Each new key/value is written in place at its (slot, column) (one
``index_copy_`` into the flat buffer); attention runs per group of rows of similar counts (a decode group, one
token per row; prompt chunks of similar length), each group's queries against its slots' first ``W`` columns (a
slice when the slots are consecutive, else one row gather) with a (B, 1, T, W) boolean mask that lets query ``k`` of
row ``i`` (position ``start_i + k``) see columns ``<= start_i + k``. The model's attention modules reach the view
through their ``attend`` seam (``install_flat_attention``). Keys are cached after RoPE, so where a key sits does not
change it.

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

import itertools

import torch

from engine.contract.model_config import ModelConfig
from engine.model.attention import AttentionPlan, core_attention
from engine.model.kv_cache import KVCache
from engine.model.qwen3 import SelfAttention

BLOCK = 16  # tokens per prefix-cache block (vLLM's default block size)


class SlotCache(KVCache):
    """``max_num_seqs`` rows of ``max_model_len`` positions per layer; ``lengths[s]`` is what slot ``s`` holds."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__(cfg, max_num_seqs, max_model_len, dtype, device, num_kv_heads)
        self.lengths = [0] * max_num_seqs
        # the lowest-numbered free slot is taken first: running rows stay consecutive and read as one slice (a
        # gather of scattered rows costs more per step than recomputing an evicted prefix once)
        self.free = list(range(max_num_seqs))
        self.content: list[list[int]] = [[] for _ in range(max_num_seqs)]  # tokens whose keys/values the slot holds
        self.adapter = [0] * max_num_seqs  # the LoRA adapter the slot's keys/values went through
        self._hashes: list[list[int]] = [[] for _ in range(max_num_seqs)]  # chained hash of each full block
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
    """The ``KVCache`` of one mixed forward over some slots of a ``SlotCache``: row ``i`` appends ``counts[i]``
    tokens (a prompt chunk, or one decode token) after what slot ``slots[i]`` holds, all rows' tokens flattened into
    one (1, N) batch in row order. ``update`` writes every new key/value at its (slot, column) in one
    ``index_copy_`` and hands the layer the whole buffers; ``attend`` (installed on the model by
    ``install_flat_attention``) then runs attention per group of rows of similar counts, each row's queries against
    its own slot's columns, masked causally from the row's start (see the module docstring)."""

    def __init__(self, parent: SlotCache, slots: list[int], counts: list[int]) -> None:  # no super(): shares buffers
        self.parent, self.slots, self.counts = parent, slots, counts
        self.keys, self.values = parent.keys, parent.values
        self.max_len = parent.max_len
        self.starts = [parent.lengths[s] for s in slots]
        device = next(iter(parent.keys.values())).device
        self.offsets = list(itertools.accumulate(counts, initial=0))  # row i's tokens: offsets[i] .. offsets[i + 1]
        self.tokens = self.offsets[-1]  # N
        rows = [i for i, n in enumerate(counts) for _ in range(n)]
        cols = [self.starts[i] + k for i, n in enumerate(counts) for k in range(n)]
        self._positions = torch.tensor(cols, device=device)[None]  # (1, N)
        slot = torch.tensor([slots[i] for i in rows], device=device)
        _, heads, length, _ = next(iter(parent.keys.values())).shape
        # each (token, head)'s row in the buffer seen as (slots * heads * length, d): index_copy_ writes just those
        # rows (an index_put over dims 0 and 2 costs as much as touching the whole buffer)
        flat = (slot[:, None] * heads + torch.arange(heads, device=device)[None, :]) * length
        self._flat = (flat + self._positions[0][:, None]).reshape(-1)
        self.last = torch.tensor([o - 1 for o in self.offsets[1:]], device=device)  # each row's last token
        self.groups = [_Group(self, members, device) for members in similar_sizes(counts)]

    def positions(self) -> torch.Tensor:
        """(1, N) position ids: each row's new tokens after its slot's length."""
        return self._positions

    @property
    def length(self) -> int:
        """0: the model plans no attention of its own for a flat batch (``attend`` masks per row)."""
        return 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (1, n_kv, N, d): written at their slots' columns; returns the layer's whole buffers."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if len(self.slots) == 1:
            slot, start = self.slots[0], self.starts[0]
            keys[slot, :, start : start + self.tokens] = k[0]
            values[slot, :, start : start + self.tokens] = v[0]
        else:
            d = keys.shape[-1]
            keys.view(-1, d).index_copy_(0, self._flat, k[0].transpose(0, 1).reshape(-1, d).to(keys.dtype))
            values.view(-1, d).index_copy_(0, self._flat, v[0].transpose(0, 1).reshape(-1, d).to(values.dtype))
        return keys, values

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q (1, nh, N, d) and a layer's whole buffers -> (1, N, nh, d): each group of rows one attention call."""
        queries = q[0].transpose(0, 1)  # (N, nh, d)
        n, heads, d = queries.shape
        out: torch.Tensor | None = None
        for g in self.groups:
            qg = queries if g.whole else queries.index_select(0, g.gather)
            qg = qg.reshape(g.batch, g.new, heads, d).transpose(1, 2)  # (B, nh, T, d)
            if g.span is not None:
                kg, vg = keys[g.span, :, : g.width], values[g.span, :, : g.width]
            else:
                kg, vg = keys[:, :, : g.width][g.rows], values[:, :, : g.width][g.rows]
            og = core_attention(qg, kg, vg, g.plan).reshape(g.batch * g.new, heads, d)  # (B * T, nh, d)
            if g.whole:
                return og[None]
            if g.pick is not None:
                og = og.index_select(0, g.pick)
            if out is None:
                out = og.new_empty(n, heads, d)
            out.index_copy_(0, g.scatter, og)
        assert out is not None  # a view has at least one row
        return out[None]

    def commit(self, tokens: list[list[int]]) -> None:
        """After the forward: each slot now holds its new tokens (``tokens[i]``, row i's ids)."""
        for s, start, ids in zip(self.slots, self.starts, tokens, strict=True):
            self.parent.lengths[s] = start + len(ids)
            self.parent._append(s, ids)

    def reset(self) -> None:
        raise RuntimeError("reset: a slot view cannot be reset; release its slots")

    def crop(self, length: int) -> None:
        raise RuntimeError("crop: a slot view cannot be cropped")


class _Group:
    """Rows of one ``SlotView`` whose attention runs as one right-padded (B, nh, T, d) call: their queries gathered
    from the flat tokens, their slots' first ``width`` columns read (a slice when the slots are consecutive), a
    (B, 1, T, W) mask letting query ``k`` of row ``i`` see columns ``<= start_i + k``."""

    def __init__(self, view: SlotView, members: list[int], device: torch.device) -> None:
        counts = [view.counts[i] for i in members]
        starts = [view.starts[i] for i in members]
        slots = [view.slots[i] for i in members]
        self.batch, self.new = len(members), max(counts)
        self.width = max(s + n for s, n in zip(starts, counts, strict=True))
        # query k of row i is flat token offsets[i] + k; padding repeats the row's last token (its output unused)
        gather = [
            view.offsets[i] + min(k, n - 1) for i, n in zip(members, counts, strict=True) for k in range(self.new)
        ]
        self.whole = gather == list(range(view.tokens))  # the group is the whole batch, in order, unpadded
        self.gather = torch.tensor(gather, device=device)
        real = [r * self.new + k for r, n in enumerate(counts) for k in range(n)]
        self.pick = None if len(real) == len(gather) else torch.tensor(real, device=device)
        self.scatter = torch.tensor(
            [view.offsets[i] + k for i in members for k in range(view.counts[i])], device=device
        )
        lo = slots[0]
        self.span = slice(lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else None
        self.rows = torch.tensor(slots, device=device)
        if device.type == "cpu" and all(s == 0 for s in starts) and all(n == self.new for n in counts):
            # whole prompts from column 0 (no cached prefix, no earlier chunk): the mask is plain causal, and CPU
            # SDPA's causal kernel skips the blocks above the diagonal (a 2,000-token prompt's attention 75 -> 38 ms
            # a layer, 1 thread) with the mask's numbers (checked bit for bit, 1 to 2,015 tokens, 1 and 2 threads)
            self.plan = AttentionPlan(mask=None, is_causal=True)
            return
        query_pos = torch.tensor(starts, device=device)[:, None] + torch.arange(self.new, device=device)[None, :]
        mask = (torch.arange(self.width, device=device)[None, None, :] <= query_pos[:, :, None])[:, None]
        # CPU SDPA takes GQA with a mask directly (no k/v expansion); core_attention expands elsewhere
        self.plan = AttentionPlan(mask=mask, is_causal=False, native_gqa=True)


def similar_sizes(counts: list[int]) -> list[list[int]]:
    """Row indices grouped so that right-padding each group to its longest row stays under half its real tokens
    (a 20-token prompt chunk is not padded to a 2,000-token one; decode rows, 1 token each, form one group); each
    group in row order."""
    groups: list[list[int]] = []
    for i in sorted(range(len(counts)), key=lambda i: -counts[i]):
        group = groups[-1] if groups else None
        if group and (len(group) + 1) * counts[group[0]] <= 1.5 * (sum(counts[j] for j in group) + counts[i]):
            group.append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


class FlatAttention:
    """Installed as every attention module's ``attend`` (``install_flat_attention``): while a ``SlotView`` is
    current (one serving forward) attention runs per row through it, otherwise as the model's own."""

    def __init__(self) -> None:
        self.view: SlotView | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        if self.view is None:
            return core_attention(q, k, v, plan)
        return self.view.attend(q, k, v)


def install_flat_attention(model: torch.nn.Module) -> FlatAttention:
    """Route every ``SelfAttention`` of ``model`` through one ``FlatAttention`` (a module's ``attend`` is the seam
    context parallelism wraps too)."""
    flat = FlatAttention()
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.attend = flat
    return flat
