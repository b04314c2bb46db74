"""Stage grpo's rollouts: prompts from instruction data, and completions sampled by the policy being trained.

A prompt is an instruction sample's tokens before its first labelled token (the chat template's prompt, up to and
including ``<|im_start|>assistant\\n`` and whatever the template put there, e.g. Qwen3's empty thinking block with
``enable_thinking`` false); the labelled tokens, decoded, are the reference answer the rewards compare with.

Decoding runs on the policy's own weights (no second copy) through the model's KV cache, laid out as
``engine.eval.generate`` lays it out (left padding, positions from the mask, last-position logits only) and sampled
by ``engine.train.grpo_sampling`` (temperature, then top-k, then top-p: ``transformers``' order, by inverse CDF).
The layout is restated here, not imported: ``engine.eval`` imports ``engine.train``. A completion is its tokens up to
and including the first stop token, or ``max_completion_length`` tokens (truncated), as TRL's completion mask has it. Each prompt's group
is sampled by its own generator, seeded with (seed, rollout, the prompt's place in the rollout), so a resumed run
samples exactly what it would have, and a DP rank decoding its share of the groups samples what one process would.

Under data parallel each rank decodes its share of the groups, padded to the whole rollout's longest prompt, and
the ranks step together until every rank's rows have stopped (FSDP's forwards are collective). Under tensor
parallel every TP rank decodes the same rows on its shard: the head's logits are all-gathered, the same generators
draw the same tokens. Under pipeline parallel each token's forward runs stage by stage (``engine.parallel.
pipeline_decode``, each rank's KV cache holding its own layers); the last stage samples and broadcasts the tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from engine.contract.constants import IGNORE_INDEX
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput
from engine.model.decoder_lm import decoder_lm
from engine.model.kv_cache import KVCache
from engine.parallel.pipeline_decode import PipelineDecode
from engine.parallel.pipeline_parallel import PipelineModel
from engine.train.data import TrainData
from engine.train.grpo_sampling import Sampling, draw_uniforms, next_tokens


def stop_ids(tokenizer: Any) -> set[int]:
    """``<|im_end|>`` and the tokenizer's EOS (``engine.eval.job.stop_ids``)."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return {t for t in (im_end, tokenizer.eos_token_id) if isinstance(t, int) and t >= 0}


def _left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device, width: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(width, *(len(p) for p in prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long, device=device)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


class HeadLogits:
    """(B, T, H) -> (B, V) fp32 logits of the last position; a vocab-parallel head's (TP) all-gathered over the
    vocabulary, so every TP rank samples from the same logits (``engine.eval.generate.last_logits``).

    A plain head writes into two buffers kept across a decode's steps, handed to the sampler to overwrite: a fresh
    (B, V) fp32 tensor each step is fresh pages to fault in (the benches pin glibc's mmap threshold at 128 KiB, as
    large blocks are once freed), three of them a step at 16 × 151,936. The product is taken as (W @ last^T)^T: for
    a few rows on CPU the matmul then streams the (V, H) matrix in its own row order, about 25% faster than
    ``last @ W^T``, where a decode step spends most of its time."""

    def __init__(self) -> None:
        self.cols: torch.Tensor | None = None  # (V, B): the product
        self.rows: torch.Tensor | None = None  # (B, V): its transpose, the sampler's rows

    @torch.no_grad()  # sampling's logits: never differentiated (``out=`` takes no autograd)
    def __call__(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        weight = decoder_lm(model).output_weight()
        if isinstance(hidden, DTensor):  # sequence parallel: each TP rank holds a slice of the positions
            hidden = hidden.full_tensor()
        last = hidden[:, -1]
        if isinstance(weight, DTensor):
            local = (last @ weight.to_local().t()).float()
            return DTensor.from_local(local, weight.device_mesh, [Shard(-1)], run_check=False).full_tensor()
        if last.dtype != weight.dtype or weight.dtype != torch.float32:
            return (weight @ last.t()).t().float().contiguous()
        shape = (weight.shape[0], last.shape[0])
        if self.cols is None or self.cols.shape != shape or self.cols.device != last.device:
            self.cols = torch.empty(shape, dtype=torch.float32, device=last.device)
            self.rows = torch.empty(shape[::-1], dtype=torch.float32, device=last.device)
        assert self.rows is not None
        torch.mm(weight, last.t(), out=self.cols)
        return self.rows.copy_(self.cols.t())


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


def group_generator(seed: int, rollout: int, prompt: int, device: torch.device) -> torch.Generator:
    """The sampler's generator of one prompt's group in one rollout (``prompt``: its position in the rollout): a
    function of (seed, rollout, prompt) alone, so a resume repeats it and a DP rank draws what one process would."""
    mixed = int(np.random.SeedSequence([seed % 2**63, rollout, prompt]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(mixed)


@dataclasses.dataclass
class Decoded:
    completions: list[list[int]]  # each up to and including its stop token
    truncated: list[bool]


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    max_new: int
    stop_ids: frozenset[int]
    pad_id: int
    sampling: Sampling
    group: int  # consecutive rows sharing one generator (a prompt's num_generations)
    width: int = 0  # left-pad prompts to at least this (the whole rollout's longest: every rank pads alike)
    together: bool = False  # ranks decode in lockstep (their forwards are collective): stop when all are done
    tp: int = 1  # the model's tensor-parallel size: a TP rank caches num_query_groups / TP KV heads
    share_prompts: bool = True  # a group's rows with one prompt: prefill it once (off: every row, as a check)


def _all_done(done: torch.Tensor, together: bool) -> bool:
    """Every row stopped: this rank's, or with ``together`` every rank's (one all-reduce per token)."""
    if not together:
        return bool(done.all())
    left = (~done).sum().reshape(1)
    dist.all_reduce(left)
    return int(left) == 0


class _Stepper:
    """Decode's forwards and sampling on one module holding every layer (plain, FSDP, TP/SP): every rank has the
    last position's hidden states, and under TP every TP rank samples the same tokens from all-gathered logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers: list[int] | None = None  # the KV cache's layers: all
        self.logits = HeadLogits()

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        hidden = self.model(ids, position_ids=pos, attention_mask=mask, kv_cache=cache, return_hidden=True)
        if isinstance(hidden, DTensor):  # sequence parallel: each TP rank holds a slice of the positions
            hidden = hidden.full_tensor()
        return hidden[:, -1:]

    def sample(self, hidden: torch.Tensor | None, sampling: Sampling, u: torch.Tensor) -> torch.Tensor:
        assert hidden is not None  # every rank holds the whole model's output
        return next_tokens(self.logits(self.model, hidden), sampling, u, scratch=True)


class _PipelineStepper:
    """Under PP (``engine.parallel.pipeline_decode``): each rank runs its stages on a KV cache of its own layers;
    the last stage samples, and its tokens are broadcast to every PP rank."""

    def __init__(self, model: PipelineModel, cfg: ModelConfig) -> None:
        self.staged = PipelineDecode(model.pipeline, cfg.hidden_size)
        self.last = model.pipeline.parts[-1]
        self.layers: list[int] | None = self.staged.layers
        self.logits = HeadLogits()

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        hidden = self.staged.forward(ids, pos, mask, cache)
        return None if hidden is None else hidden[:, -1:]

    def sample(self, hidden: torch.Tensor | None, sampling: Sampling, u: torch.Tensor) -> torch.Tensor:
        if hidden is None:
            token = torch.empty(u.shape[0], dtype=torch.long, device=u.device)
        else:
            token = next_tokens(self.logits(self.last, hidden), sampling, u, scratch=True)
        return self.staged.from_last(token)


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    opts: DecodeOptions,
    generators: Sequence[torch.Generator | None],
) -> Decoded:
    """Sample one completion per prompt, all rows in one batch, through a KV cache (under PP each rank's stages on
    a cache of their layers). ``no_grad``, not ``inference_mode``: FSDP keeps the root's gathered parameters after
    forward for the training step that follows, and inference tensors could not take part in its autograd."""
    params = list(model.parameters())
    # the cache's dtype: the embedding's on one process (the frozen base's under LoRA, else the trainable weights');
    # a later pipeline stage holds no embedding, so a parameter of the same kind, frozen or not
    param = next((p for p in params if not p.requires_grad), params[0])
    device, dtype = param.device, param.dtype
    step = _PipelineStepper(model, cfg) if isinstance(model, PipelineModel) else _Stepper(model)
    ids, mask = _left_pad(prompts, opts.pad_id, device, opts.width)
    pos = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    kv_heads = cfg.num_query_groups // opts.tp
    length = ids.shape[1] + opts.max_new
    group = opts.group
    shared = (
        opts.share_prompts
        and group > 1
        and len(prompts) % group == 0
        and all(prompts[i] == prompts[i - i % group] for i in range(len(prompts)))
    )
    if shared:  # each group's rows share its prompt: prefill it once, then each row decodes on its own copy
        once = KVCache(cfg, ids.shape[0] // group, ids.shape[1], dtype, device, kv_heads, step.layers)
        firsts = slice(None, None, group)
        hidden = step.forward(ids[firsts], pos[firsts], mask[firsts], once)
        cache = once.repeat_rows(group, length)
        del once
        hidden = None if hidden is None else hidden.repeat_interleave(group, dim=0)
    else:
        cache = KVCache(cfg, ids.shape[0], length, dtype, device, kv_heads, step.layers)
        hidden = step.forward(ids, pos, mask, cache)
    stop = torch.tensor(sorted(opts.stop_ids), dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out: list[torch.Tensor] = []
    uniforms = draw_uniforms(generators, opts.group, opts.max_new, device)
    for t in range(opts.max_new):
        token = step.sample(hidden, opts.sampling, uniforms[t])
        token = torch.where(done, torch.full_like(token, opts.pad_id), token)
        out.append(token)
        done = done | torch.isin(token, stop)
        if t + 1 == opts.max_new or _all_done(done, opts.together):
            break
        pos = pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        hidden = step.forward(token[:, None], pos, mask, cache)
    rows = torch.stack(out, dim=1).tolist()
    completions, truncated = [], []
    for row in rows:
        cut = next((i for i, tok in enumerate(row) if tok in opts.stop_ids), None)
        completions.append(row if cut is None else row[: cut + 1])
        truncated.append(cut is None)
    return Decoded(completions, truncated)
