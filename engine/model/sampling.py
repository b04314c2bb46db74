"""Choosing the next token from logits: greedy, or sampling with temperature / top-k / top-p.

The order of the filters is ``transformers``' (temperature, then top-k, then top-p), so a seeded sampling run here
and ``model.generate(do_sample=True, ...)`` apply the same distribution. MindSpeed's convention that ``top_k=0`` and
``top_p=0`` mean "off" is kept (its inference defaults, ``docs/megatron-interop.md`` §6).
"""

from __future__ import annotations

import dataclasses

import torch

# The seed runs eval with ``--temperature 0.00001``: sampling that cold is argmax up to exact ties, so anything
# below this threshold is decoded greedily (no 1e5-scaled logits, no random draws, deterministic across devices).
GREEDY_BELOW = 1e-3


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token. ``temperature < GREEDY_BELOW`` (0 included) means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in [0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A generator seeded with ``seed`` for sampling; None when decoding is greedy."""
        if self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scale by temperature and mask (to -inf) the tokens top-k / top-p exclude. ``logits``: (B, V) float."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (B, 1) smallest logit kept
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``logits`` (B, V) -> (B,) long."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
