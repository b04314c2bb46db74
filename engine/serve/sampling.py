"""Per-request sampling for serving: OpenAI's parameters on top of ``engine.model.sampling``.

The penalties follow vLLM's (and OpenAI's) definitions: ``repetition_penalty`` divides the positive logits (multiplies
the negative ones) of every token seen in the prompt or the output; ``frequency_penalty`` subtracts
``count × penalty`` and ``presence_penalty`` subtracts ``penalty`` once, for each token of the output so far.
Temperature / top-k / top-p and the greedy rule are ``engine.model.sampling``'s. Log-probabilities are those of the
model's raw distribution (before penalties and filters), as vLLM reports by default.

A sequence with a grammar (``engine.serve.structured.Constraint``: ``response_format``, tool_choice ``required``)
has the tokens it forbids set to -inf after the penalties, and the sampled token advances it.

Every value the documented ranges admit gives a token: penalties can push a logit past fp32's range
(``repetition_penalty`` 1e-300 divides by it), so the penalised scores are clamped to a finite band that even the
coldest sampling temperature cannot overflow, and the sampler never sees ``inf``/``nan``. Logits the *model*
made non-finite are its fault, not the request's: ``SamplingError``, which fails that sequence only.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from engine.contract.serve_request import SamplingOptions
from engine.model.sampling import GREEDY_BELOW, SamplingParams, next_tokens
from engine.serve.structured import Constraint

# |score| bound after penalties: divided by the coldest sampling temperature (GREEDY_BELOW) it stays finite, and the
# softmax's ``x - max`` of two such values too
SCORE_LIMIT = torch.finfo(torch.float32).max * GREEDY_BELOW / 4


class SamplingError(Exception):
    """The model's logits for one sequence are not finite: that sequence cannot be sampled (a fault of the model)."""


class RequestOptions(SamplingOptions):
    """A request's sampling options (``engine.contract.serve_request``: their fields, defaults and checks) with the
    engine's side: the sampler's parameters and each choice's generator. It adds no field."""

    @classmethod
    def of(cls, options: SamplingOptions) -> RequestOptions:
        return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)})

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed or 0)

    def generator(self, index: int, device: torch.device) -> torch.Generator | None:
        """The generator of the ``index``-th of the ``n`` choices: seeded with ``seed + index``, else at random."""
        params = self.sampling()
        if params.greedy:
            return None
        seed = (self.seed + index) % 2**64 if self.seed is not None else int(torch.randint(0, 2**62, ()).item())
        return torch.Generator(device=device).manual_seed(seed)


def apply_penalties(logits: torch.Tensor, opts: RequestOptions, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``logits`` (V,) with the request's penalties applied (a new tensor when any applies)."""
    if opts.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(picked > 0, picked / opts.repetition_penalty, picked * opts.repetition_penalty)
    if output and (opts.frequency_penalty or opts.presence_penalty):
        counts = Counter(output)
        ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        n = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits = logits.clone()
        logits[ids] -= opts.frequency_penalty * n + opts.presence_penalty
    return logits


@dataclasses.dataclass
class Pick:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token, logprob), most likely first


def pick_token(
    logits: torch.Tensor,
    opts: RequestOptions,
    prompt: list[int],
    output: list[int],
    generator: torch.Generator | None,
    constraint: Constraint | None = None,
) -> Pick:
    """The next token of one sequence from its (V,) float logits, within ``constraint``'s grammar when it has one;
    ``SamplingError`` when the logits are not finite."""
    logits = logits.float()
    if not bool(torch.isfinite(logits).all()):
        raise SamplingError("the model's logits are not finite")
    scores = apply_penalties(logits, opts, prompt, output).clamp(-SCORE_LIMIT, SCORE_LIMIT)
    if constraint is not None:
        scores = constraint.mask(scores)  # finite where allowed: the clamp came first
    token = int(next_tokens(scores[None], opts.sampling(), generator)[0])
    if constraint is not None:
        constraint.advance(token)
    if opts.logprobs is None:
        return Pick(token)
    logp = torch.log_softmax(logits, dim=-1)
    top: list[tuple[int, float]] = []
    if opts.logprobs:
        values, ids = torch.topk(logp, min(opts.logprobs, logp.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return Pick(token, float(logp[token]), top)
