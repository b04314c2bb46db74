"""Stage dpo: the reference model and the micro-batch loss of preference training.

The reference is the run's starting weights, chosen by the spec:

- LoRA: the policy itself with its adapters off (``engine.model.lora.adapters_disabled``): no second copy.
- otherwise a frozen second model built like the policy (meta device, the same sharding, parameters frozen before
  the dtype pass so they are stored in the compute dtype; no grads, no optimizer state), filled from ``ref_model`` or
  else ``load`` (or the policy's seeded initial weights when nothing is loaded).
- none for the reference-free losses (simpo, orpo).

Either way the reference is read from where the run started, never from ``<save>/train_state``: a resumed run keeps
its reference pinned to the initial weights (MindSpeed's ``refer_model_iter`` is accepted for that reason only).

A micro-batch is ``[chosen; rejected]`` padded rows (``batches.collate_pairs``); one forward gives each row's summed
log-probs through the chunked head (``preference.sequence_logprobs``), the reference's under ``no_grad``. The loss is
the per-pair loss summed over the micro-batch; the loop divides by the global pair count (``MicroBatch.loss_units``),
so the step's gradient is that of the mean over the global batch whatever the DP size or micro-batch split. The
pref_ftx term is TRL's: the mean over the micro-batch's chosen tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_reduce
from torch.distributed.tensor import DTensor

from engine.checkpoint import dcp
from engine.checkpoint.sources import SeededInit, WeightSource
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput
from engine.contract.spec import TrainSpec
from engine.load.rank_model import build_rank_model
from engine.load.weights import open_load, rank_view
from engine.model.decoder_lm import decoder_lm
from engine.model.lora import adapters_disabled
from engine.model.moe import paused_router_stats
from engine.parallel.mesh import mesh_dims
from engine.parallel.tensor_parallel import vocab_parallel_row_logit_sums, vocab_parallel_sequence_logprobs
from engine.train.batches import MicroBatch
from engine.train.metrics import PER
from engine.train.preference import (
    REFERENCE_FREE,
    PairLogps,
    PreferenceConfig,
    preference_loss,
    row_logit_sums,
    sequence_logprobs,
)
from engine.train.step_runner import Losses, MicroBatchLoss

# preference_loss's per-pair metrics -> TRL's DPOTrainer names
_TRL_NAMES = {
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "rewards_margin": "rewards/margins",
    "rewards_accuracy": "rewards/accuracies",
}


def preference_config(spec: TrainSpec) -> PreferenceConfig:
    return PreferenceConfig(
        loss_type=spec.dpo_loss_type,
        beta=spec.dpo_beta,
        label_smoothing=spec.dpo_label_smoothing,
        pref_ftx=spec.pref_ftx,
        simpo_gamma=spec.simpo_gamma,
    )


@dataclasses.dataclass
class Reference:
    """The model whose log-probs the policy's are compared with; ``adapters_off``: ``module`` is the LoRA policy."""

    module: nn.Module
    adapters_off: bool
    vocab_parallel: bool = False

    def logps(self, mb: MicroBatch, chunk_size: int) -> torch.Tensor:
        off = adapters_disabled(self.module) if self.adapters_off else contextlib.nullcontext()
        # paused: a LoRA policy's MoE routing figures count its training forwards only
        with torch.no_grad(), off, paused_router_stats(self.module):
            return row_logps(self.module, mb, chunk_size, self.vocab_parallel).logps


@dataclasses.dataclass
class RowLogps:
    """A micro-batch's rows: summed log-probs (differentiable), labelled tokens, and (the policy's only) the logits
    summed over labelled positions and the vocabulary, with the vocabulary size."""

    logps: torch.Tensor
    tokens: torch.Tensor
    logit_sums: torch.Tensor | None = None
    vocab: int = 0


def row_logps(
    model: nn.Module, mb: MicroBatch, chunk_size: int, vocab_parallel: bool = False, logits: bool = False
) -> RowLogps:
    """Each row of ``mb``: summed log-probs and labelled tokens, with ``logits`` the logit sums TRL reports too;
    ``vocab_parallel``: the head is vocab-sharded over TP (the hidden states may be sequence-sharded)."""
    hidden = model(
        mb.input_ids, position_ids=mb.position_ids, segment_ids=mb.segment_ids, return_hidden=True, counted=mb.counted
    )
    lm = decoder_lm(model)
    head = lm.output_weight()
    rows = rows_from_hidden(hidden, head, mb.labels, chunk_size, vocab_parallel, logits, mb.loss_index, into_grad=True)
    return over_context(rows, lm.context_group)


def over_context(rows: RowLogps, group: dist.ProcessGroup | None) -> RowLogps:
    """Under context parallelism (``group`` the CP group; None: none) a rank holds part of every row: its sums are
    completed over the CP group, so every CP rank computes the whole pair loss. Its gradient comes back summed over
    the group (the all-reduce's backward), which the step's pair count undoes: every CP rank counts the micro-batch's
    pairs, so the global count is CP ×."""
    if group is None:
        return rows
    logps = all_reduce(rows.logps, group=group)  # differentiable
    tokens = rows.tokens.clone()
    dist.all_reduce(tokens, group=group)
    sums = None
    if rows.logit_sums is not None:
        sums = rows.logit_sums.detach().clone()
        dist.all_reduce(sums, group=group)
    return RowLogps(logps, tokens, sums, rows.vocab)


def rows_from_hidden(
    hidden: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    vocab_parallel: bool,
    logits: bool,
    loss_index: torch.Tensor | None = None,
    into_grad: bool = False,
) -> RowLogps:
    """``row_logps`` from the final hidden states (a pipeline's last stage has nothing else); ``loss_index`` the
    labelled flat positions when known (else found from ``labels``); ``into_grad``: a replicated head's gradient
    goes straight into its ``.grad`` (``preference.sequence_logprobs``; micro-batches trained by ``.backward()``
    one after another). Not under a pipeline schedule: there the last stage's first backward ran over non-finite
    hidden states (seemingly the shape-inference forward of empty tensors) without reaching the parameters through
    autograd, but a gradient written by hand stays (a PP2 run's first step then had a non-finite grad norm)."""
    if vocab_parallel:
        logps, tokens = vocab_parallel_sequence_logprobs(hidden, head, labels, chunk_size, loss_index)
        sums = vocab_parallel_row_logit_sums(hidden, head, labels, loss_index) if logits else None
    else:
        logps, tokens = sequence_logprobs(hidden, head, labels, chunk_size, into_grad=into_grad)
        sums = row_logit_sums(hidden, head, labels) if logits else None
    return RowLogps(logps, tokens, sums, head.shape[0])  # a DTensor's shape is the global one


def stat_names() -> list[str]:
    """Every stat ``pair_losses`` reports, so ranks that compute none (a pipeline's other stages) carry zeros."""
    names = [*_TRL_NAMES.values(), "logps/chosen", "logps/rejected"]
    return sorted([*names, *(f"logits/{s}{per}" for s in ("chosen", "rejected") for per in ("", PER))])


def pair_losses(cfg: PreferenceConfig, rows: RowLogps, pairs: int, ref: torch.Tensor | None) -> Losses:
    """The summed per-pair loss of rows ``[chosen; rejected]`` (``pairs`` of each) and TRL's metrics as per-pair
    sums (``stats``); ``ref`` the reference's row log-probs (None: reference-free)."""
    if ref is None and cfg.loss_type not in REFERENCE_FREE:
        raise RuntimeError(f"dpo_loss_type {cfg.loss_type}: no reference log-probs for this micro-batch")
    logps, tokens, p = rows.logps, rows.tokens, pairs
    pair = PairLogps(
        logps[:p],
        logps[p:],
        tokens[:p],
        tokens[p:],
        None if ref is None else ref[:p],
        None if ref is None else ref[p:],
    )
    per_pair, metrics = preference_loss(cfg, pair)
    stats = {_TRL_NAMES[k]: v.sum().float() for k, v in metrics.items()}
    # as the loss reads them (TRL's CPO/ORPO trainers too): summed, length-normalised for simpo and orpo
    norm = cfg.loss_type in REFERENCE_FREE
    for name, logp, n in (
        ("chosen", pair.chosen, pair.chosen_tokens),
        ("rejected", pair.rejected, pair.rejected_tokens),
    ):
        stats[f"logps/{name}"] = (logp.detach() / n if norm else logp.detach()).sum().float()
    assert rows.logit_sums is not None
    for name, half in (("chosen", slice(None, p)), ("rejected", slice(p, None))):
        # TRL's mean over every labelled position and vocabulary entry: a sum and its count (metrics divides)
        stats[f"logits/{name}"] = rows.logit_sums[half].sum()
        stats[f"logits/{name}{PER}"] = (tokens[half].sum() * rows.vocab).float()
    return Losses(per_pair.sum().float(), stats=stats)


def dpo_loss(
    cfg: PreferenceConfig, reference: Reference | None, chunk_size: int, vocab_parallel: bool = False
) -> MicroBatchLoss:
    """The micro-batch loss of stage dpo: summed per-pair loss, with TRL's metrics as per-pair sums (``stats``)."""

    def loss(model: nn.Module, mb: MicroBatch) -> Losses:
        rows = row_logps(model, mb, chunk_size, vocab_parallel, logits=True)
        ref = mb.ref_logps
        if ref is None and reference is not None:
            ref = reference.logps(mb, chunk_size)
        return pair_losses(cfg, rows, mb.pairs, ref)

    return loss


class PipelineDPOLoss:
    """Stage dpo on a pipeline's last stage: the schedule hands the loss function each micro-batch's final hidden
    states and (padded) labels, so the pairs and precomputed reference log-probs of the step's
    micro-batches are kept by ``begin`` and looked up by the index the labels carry; the stats are summed over the
    step; under context parallelism the row sums are completed over ``context_group``. The
    reference must be precomputed (or the loss reference-free): a frozen copy would need its own pipeline."""

    def __init__(self, cfg: PreferenceConfig, chunk_size: int, context_group: dist.ProcessGroup | None = None) -> None:
        self.cfg, self.chunk_size, self.context_group = cfg, chunk_size, context_group
        self.batches: Sequence[MicroBatch] = ()
        self.device = torch.device("cpu")
        self.per_batch: dict[int, dict[str, torch.Tensor]] = {}  # by index: a repeated call replaces, not adds

    def begin(self, batches: Sequence[MicroBatch], device: torch.device) -> None:
        self.batches, self.device, self.per_batch = batches, device, {}

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """The step's stats summed over its micro-batches (zeros where this rank computed none)."""
        out = {name: torch.zeros((), device=self.device) for name in stat_names()}
        for stats in self.per_batch.values():
            for name, value in stats.items():
                out[name] = out[name] + value
        return out

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor, head: torch.Tensor, index: int) -> torch.Tensor:
        mb = self.batches[index]
        rows = over_context(
            rows_from_hidden(hidden, head, labels, self.chunk_size, isinstance(head, DTensor), logits=True),
            self.context_group,
        )
        ref = None if mb.ref_logps is None else mb.ref_logps.to(hidden.device)
        losses = pair_losses(self.cfg, rows, mb.pairs, ref)
        self.per_batch[index] = {name: value.detach() for name, value in losses.stats.items()}
        return losses.token_sum


def build_reference(
    spec: TrainSpec,
    cfg: ModelConfig,
    mesh: DeviceMesh,
    policy: nn.Module,
    global_batch_size: int,
    seq_length: int,
    device: torch.device,
) -> Reference | None:
    """The run's reference (see the module docstring); None for the reference-free losses."""
    if spec.dpo_loss_type in REFERENCE_FREE:
        return None
    vocab_parallel = mesh["tp"].size() > 1
    if spec.is_lora:
        return Reference(policy, adapters_off=True, vocab_parallel=vocab_parallel)
    path = spec.ref_model or spec.load
    loaded = open_load(path, rank_view(spec, mesh_dims(mesh), dist.get_rank())) if path is not None else None
    if loaded is not None and spec.ref_model is not None:
        mine, theirs = dataclasses.asdict(cfg), dataclasses.asdict(loaded.config)
        differ = [k for k in ("num_layers", "hidden_size", "vocab_size", "num_attention_heads") if mine[k] != theirs[k]]
        if differ:
            raise BadInput(f"ref_model: {path} has another shape than the policy ({differ[0]})", "ref_model")
    source: WeightSource | None = SeededInit(cfg, spec.seed) if loaded is None else loaded.source
    frozen_spec = spec.model_copy(update={"recompute_granularity": None, "recompute_activations": False})
    module = build_rank_model(cfg, mesh, frozen_spec, global_batch_size, seq_length, device, source, frozen=True)
    if loaded is not None and loaded.format == "native" and path is not None:
        dcp.load(path, module, None, trainable_only=False, load_rng=False)
    module.eval()
    return Reference(module, adapters_off=False, vocab_parallel=vocab_parallel)
