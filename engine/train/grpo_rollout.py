"""Stage grpo's rollouts: prompts from instruction data, and completions sampled by the policy being trained.

A prompt is an instruction sample's tokens before its first labelled token (the chat template's prompt, up to and
including ``<|im_start|>assistant\\n`` and whatever the template put there, e.g. Qwen3's empty thinking block with
``enable_thinking`` false); the labelled tokens, decoded, are the reference answer the rewards compare with.

Decoding runs on the policy's own weights (no second copy) through the model's KV cache, laid out as
``engine.eval.generate`` lays it out (left padding, positions from the mask, last-position logits only) and sampled
as ``engine.eval.sampling`` samples (temperature, then top-k, then top-p: ``transformers``' order). Both are
restated here, not imported: ``engine.eval`` imports ``engine.train``. A completion is its tokens up to and including the first
stop token, or ``max_completion_length`` tokens (truncated), as TRL's completion mask has it. The sampler's
generator is seeded with (seed, rollout index), so a resumed run samples exactly what it would have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from engine.contract.constants import IGNORE_INDEX
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput
from engine.model.kv_cache import KVCache
from engine.model.qwen3 import Qwen3Model
from engine.train.data import TrainData


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off


def next_tokens(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of (B, V) logits: temperature, top-k, top-p (``engine.eval.sampling.filter_logits``)."""
    logits = logits.float() / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        drop_sorted = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1.0 - s.top_p)
        drop_sorted[..., -1] = False  # the most likely token stays
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator).squeeze(-1)


def stop_ids(tokenizer: Any) -> set[int]:
    """``<|im_end|>`` and the tokenizer's EOS (``engine.eval.job.stop_ids``)."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return {t for t in (im_end, tokenizer.eos_token_id) if isinstance(t, int) and t >= 0}


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long, device=device)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _last_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return (hidden[:, -1] @ cast(Qwen3Model, model).output_weight().t()).float()


@dataclasses.dataclass(frozen=True)
class Prompt:
    index: int  # the dataset row (prompt_id)
    ids: list[int]
    reference: str


def prompt_of(data: TrainData, position: int, tokenizer: Any) -> Prompt:
    """The prompt at global sample ``position`` of the seeded order (one sample per row: its first)."""
    row = data.start + data.order.index_at(position)
    sample = data.sample_at(position)[0]
    labels = np.asarray(sample.labels)
    labelled = np.flatnonzero(labels != IGNORE_INDEX)
    if labelled.size == 0:
        raise BadInput(f"data_path: row {row} has no assistant answer (no labelled token) to take a prompt from")
    ids = [int(t) for t in np.asarray(sample.input_ids)[: labelled[0]]]
    if not ids:
        raise BadInput(f"data_path: row {row} has an empty prompt", "data_path")
    reference = tokenizer.decode([int(t) for t in labels[labelled]], skip_special_tokens=True)
    return Prompt(row, ids, reference)


def rollout_generator(seed: int, rollout: int, device: torch.device) -> torch.Generator:
    """The sampler's generator of one rollout: a function of (seed, rollout) alone, so a resume repeats it."""
    mixed = int(np.random.SeedSequence([seed % 2**63, rollout]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(mixed)


@dataclasses.dataclass
class Decoded:
    completions: list[list[int]]  # each up to and including its stop token
    truncated: list[bool]


@torch.inference_mode()
def decode(
    model: torch.nn.Module,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    stop_ids: set[int],
    pad_id: int,
    sampling: Sampling,
    generator: torch.Generator | None,
) -> Decoded:
    """Sample one completion per prompt, all rows in one batch, through a KV cache."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    ids, mask = _left_pad(prompts, pad_id, device)
    pos = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    cache = KVCache(cfg, ids.shape[0], ids.shape[1] + max_new, dtype, device)
    hidden = model(ids, position_ids=pos, attention_mask=mask, kv_cache=cache, return_hidden=True)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[torch.Tensor] = []
    for t in range(max_new):
        token = next_tokens(_last_logits(model, hidden), sampling, generator)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        out.append(token)
        done = done | torch.isin(token, stop)
        if bool(done.all()) or t + 1 == max_new:
            break
        pos = pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        hidden = model(token[:, None], position_ids=pos, attention_mask=mask, kv_cache=cache, return_hidden=True)
    rows = torch.stack(out, dim=1).tolist()
    completions, truncated = [], []
    for row in rows:
        cut = next((i for i, tok in enumerate(row) if tok in stop_ids), None)
        completions.append(row if cut is None else row[: cut + 1])
        truncated.append(cut is None)
    return Decoded(completions, truncated)
