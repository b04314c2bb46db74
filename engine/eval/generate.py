"""Batched autoregressive decoding for a ``engine.model.decoder_lm.DecoderLM``: left padding, KV cache, stop tokens.

The layout follows ``transformers``' ``generate`` so that greedy outputs match it token for token: prompts are
left-padded, position ids are ``cumsum(attention_mask) - 1`` (so every prompt starts at position 0 whatever its
padding), and rows that have stopped keep receiving the pad token while the rest of the batch decodes.
Only the last position's logits are computed (``return_hidden`` + the head matrix): a prefill of B×T×151936 float
logits would dwarf the model on a long prompt.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import torch

from engine.model.sampling import SamplingParams, next_tokens
from engine.parallel.vocab_head import last_logits


@dataclasses.dataclass
class Generation:
    """Result of decoding one batch of prompts."""

    tokens: list[list[int]]  # new tokens per prompt, the stop token excluded
    finish_reasons: list[str]  # "stop" (a stop token was produced) or "length" (max_new_tokens reached)
    num_generated: int  # tokens produced, stop tokens included: what throughput counts
    seconds: float


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_id: int
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    use_cache: bool = True
    tp_size: int = 1  # the model's tensor-parallel size: a TP rank holds num_query_groups / TP whole KV groups


def _device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, max_len), prompts aligned to the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long, device=device)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token; pads get 0 (they are masked anyway)."""
    return (mask.cumsum(dim=-1) - 1).clamp(min=0)


class _Stepper:
    """Runs the model for one decoding step, with or without a KV cache, keeping ids/mask/positions in step."""

    def __init__(self, model: torch.nn.Module, cfg, ids: torch.Tensor, mask: torch.Tensor, opts: DecodeOptions):
        self.model, self.opts = model, opts
        self.ids, self.mask, self.pos = ids, mask, positions_from_mask(mask)
        self.cache = None
        if opts.use_cache:
            from engine.model.kv_cache import KVCache

            device, dtype = _device_dtype(model)
            local_kv = cfg.num_query_groups // opts.tp_size
            self.cache = KVCache(
                cfg, ids.shape[0], ids.shape[1] + opts.max_new_tokens, dtype, device, num_kv_heads=local_kv
            )

    def _last_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return last_logits(self.model, hidden)

    def prefill(self) -> torch.Tensor:
        hidden = self.model(
            self.ids, position_ids=self.pos, attention_mask=self.mask, kv_cache=self.cache, return_hidden=True
        )
        return self._last_logits(hidden)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed ``token`` (B,) and return the logits for the position after it."""
        new_pos = self.pos[:, -1:] + 1
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.pos = torch.cat([self.pos, new_pos], dim=1)
        self.ids = torch.cat([self.ids, token[:, None]], dim=1)
        if self.cache is not None:
            hidden = self.model(
                token[:, None], position_ids=new_pos, attention_mask=self.mask, kv_cache=self.cache, return_hidden=True
            )
        else:
            hidden = self.model(self.ids, position_ids=self.pos, attention_mask=self.mask, return_hidden=True)
        return self._last_logits(hidden)


@torch.inference_mode()
def generate_batch(
    model: torch.nn.Module,
    cfg,
    prompts: Sequence[Sequence[int]],
    opts: DecodeOptions,
    generator: torch.Generator | None = None,
) -> Generation:
    """Decode one batch; ``cfg`` is the model's ``ModelConfig`` (the KV cache is shaped from it)."""
    start = time.perf_counter()
    device, _ = _device_dtype(model)
    ids, mask = left_pad(prompts, opts.pad_id, device)
    stepper = _Stepper(model, cfg, ids, mask, opts)
    stop = torch.tensor(opts.stop_ids, dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[torch.Tensor] = []
    logits = stepper.prefill()
    for t in range(opts.max_new_tokens):
        token = next_tokens(logits, opts.sampling, generator)
        token = torch.where(done, torch.full_like(token, opts.pad_id), token)
        out.append(token)
        done = done | torch.isin(token, stop)
        if bool(done.all()) or t + 1 == opts.max_new_tokens:
            break
        logits = stepper.step(token)
    return _collect(torch.stack(out, dim=1).tolist(), set(opts.stop_ids), time.perf_counter() - start)


def _collect(rows: list[list[int]], stop_ids: set[int], seconds: float) -> Generation:
    tokens, reasons, produced = [], [], 0
    for row in rows:
        cut = next((i for i, tok in enumerate(row) if tok in stop_ids), None)
        if cut is None:
            tokens.append(row)
            reasons.append("length")
            produced += len(row)
        else:
            tokens.append(row[:cut])
            reasons.append("stop")
            produced += cut + 1
    return Generation(tokens, reasons, produced, seconds)


def generate(
    model: torch.nn.Module, cfg, prompts: Sequence[Sequence[int]], opts: DecodeOptions, batch_size: int
) -> Iterator[tuple[list[int], Generation]]:
    """Decode all prompts ``batch_size`` at a time, yielding (prompt indices, generation) per batch.

    Prompts are grouped by length (longest first) so a batch wastes little on padding; the indices say which
    prompts each batch holds. One seeded generator serves the whole run, so sampling is reproducible.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    device, _ = _device_dtype(model)
    generator = opts.sampling.generator(device)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    for first in range(0, len(order), batch_size):
        indices = order[first : first + batch_size]
        yield indices, generate_batch(model, cfg, [prompts[i] for i in indices], opts, generator)
