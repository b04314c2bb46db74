"""Preallocated key/value cache for incremental decoding.

One (B, n_kv, max_len, head_dim) buffer pair per layer, allocated once; ``update`` writes the new keys/values after
the ones already cached and returns views of everything cached so far. Each layer keeps its own fill level, so a
pipeline stage holding only some layers (or a TP rank holding ``n_kv / TP`` heads, pass ``num_kv_heads``) works the
same. Left padding is not the cache's business: the model masks padded key columns with ``attention_mask``.
"""

from __future__ import annotations

import torch

from engine.contract.model_config import ModelConfig


class KVCache:
    """Keys/values of ``cfg.num_layers`` layers for ``batch_size`` rows and up to ``max_len`` positions."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_kv_heads: int | None = None,
        layers: list[int] | None = None,
    ) -> None:
        if max_len < 1:
            raise ValueError(f"max_len: must be at least 1, got {max_len}")
        self.max_len = max_len
        shape = (batch_size, num_kv_heads or cfg.num_query_groups, max_len, cfg.kv_channels)
        layer_ids = range(cfg.num_layers) if layers is None else layers
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self._filled = dict.fromkeys(layer_ids, 0)

    @property
    def length(self) -> int:
        """Positions cached so far (by the most advanced layer; all layers agree between forwards)."""
        return max(self._filled.values(), default=0)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, n_kv, T, d) to layer ``layer_idx``; return all cached (B, n_kv, past + T, d)."""
        start = self._filled[layer_idx]
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"max_len: KV cache holds {self.max_len} positions, {end} needed")
        self.keys[layer_idx][:, :, start:end] = k
        self.values[layer_idx][:, :, start:end] = v
        self._filled[layer_idx] = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def repeat_rows(self, repeats: int, max_len: int) -> KVCache:
        """A cache of ``max_len`` positions holding each row ``repeats`` times in a row, filled as far as this one:
        rows sharing one prompt (stage grpo's group) prefill it once and decode apart."""
        if max_len < self.length:
            raise ValueError(f"max_len: {max_len} positions cannot hold the {self.length} cached")
        out = KVCache.__new__(KVCache)
        out.max_len = max_len
        out._filled = dict(self._filled)
        out.keys, out.values = {}, {}
        for mine, theirs in ((self.keys, out.keys), (self.values, out.values)):
            for i, buf in mine.items():
                b, heads, _, dim = buf.shape
                big = torch.zeros((b * repeats, heads, max_len, dim), dtype=buf.dtype, device=buf.device)
                n = self._filled[i]
                # a broadcast copy into a view: no repeated temporary
                big.view(b, repeats, heads, max_len, dim)[:, :, :, :n] = buf[:, None, :, :n]
                theirs[i] = big
        return out

    def reset(self) -> None:
        """Forget everything (buffers are reused, not freed)."""
        self._filled = dict.fromkeys(self._filled, 0)

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions (e.g. to reuse a shared prompt)."""
        self._filled = {i: min(n, length) for i, n in self._filled.items()}
