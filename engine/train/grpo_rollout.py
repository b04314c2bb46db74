"""Stage grpo's rollouts: prompts from instruction data, and completions sampled by the policy being trained.

A prompt is an instruction sample's tokens before its first labelled token (the chat template's prompt, up to and
including ``<|im_start|>assistant\\n`` and whatever the template put there, e.g. Qwen3's empty thinking block with
``enable_thinking`` false); the labelled tokens, decoded, are the reference answer the rewards compare with.

Decoding runs on the policy's own weights (no second copy) with the engine's KV-cache decoder pieces
(``engine.eval.generate``: left padding, positions from the mask, last-position logits only; its sampler applies
temperature, top-k and top-p in ``transformers``' order). A completion is its tokens up to and including the first
stop token, or ``max_completion_length`` tokens (truncated), as TRL's completion mask has it. The sampler's
generator is seeded with (seed, rollout index), so a resumed run samples exactly what it would have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.contract.constants import IGNORE_INDEX
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput
from engine.eval.generate import last_logits, left_pad, positions_from_mask
from engine.eval.sampling import SamplingParams, next_tokens
from engine.model.kv_cache import KVCache
from engine.train.data import TrainData


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
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> Decoded:
    """Sample one completion per prompt, all rows in one batch, through a KV cache."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    ids, mask = left_pad(prompts, pad_id, device)
    pos = positions_from_mask(mask)
    cache = KVCache(cfg, ids.shape[0], ids.shape[1] + max_new, dtype, device)
    hidden = model(ids, position_ids=pos, attention_mask=mask, kv_cache=cache, return_hidden=True)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[torch.Tensor] = []
    for t in range(max_new):
        token = next_tokens(last_logits(model, hidden), sampling, generator)
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
