"""The ``train`` job's trainer (``engine.train.entry.run(spec, run) -> (outputs, summary)`` builds and runs it), on one
process or under torchrun with data parallel.

Order of work: check every input (data files, checkpoint format and shape, batch arithmetic) before touching a
device -> start the process group and the dp×pp×tp mesh -> build this rank's part on the meta device (PP split, LoRA,
TP, recompute, FSDP), materialise it and read only its own slices of ``load`` (``engine.load.rank_model``) ->
optimizer, LR schedule, loss scaler -> resume from ``<save>/train_state`` if an earlier attempt left a checkpoint ->
iterate -> final checkpoint in the seed's Megatron layout (+ HF on request).

Checkpoint semantics (MindSpeed/Megatron): ``load`` of an HF or mcore checkpoint gives weights only, iteration 0
(what ``--finetune`` does; converted checkpoints say iteration 1 and nothing else). ``load`` of our own training
checkpoint continues its iteration, optimizer (unless ``no_load_optim``) and RNG (unless ``no_load_rng``), or with
``finetune`` takes weights only and starts at 0. A checkpoint under ``save`` always wins: the service re-queues a
failed job with the same spec and expects it to continue where it stopped, optimizer and data position included.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from engine.checkpoint import dcp
from engine.checkpoint.sources import SeededInit, WeightSource
from engine.contract import owner
from engine.contract.guard import check_output
from engine.contract.inspect import checkpoint_flags
from engine.contract.layout import LayoutError
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput, RunDir
from engine.contract.spec import TrainSpec
from engine.load.rank_model import build_rank_model
from engine.load.weights import (
    LoadedWeights,
    check_against_checkpoint,
    check_model_kind,
    config_from_flags,
    open_load,
    rank_view,
    with_spec_flags,
)
from engine.parallel.device import Device
from engine.parallel.mesh import ParallelDims, build_mesh, context_mesh
from engine.parallel.parallelize import compute_dtype
from engine.parallel.pipeline_parallel import check_parallel_layout
from engine.train import preempt
from engine.train.batches import MicroBatch, collate, collate_pairs, context_pipeline_width, context_shard
from engine.train.data import TrainData, check_data_paths, rank_positions
from engine.train.export import export_final
from engine.train.loop import TrainState, eval_step, train_step
from engine.train.metrics import MetricsLogger
from engine.train.optim import LossScaler, build_optimizer
from engine.train.router_stats import RouterTracker
from engine.train.schedule import Scheduler, schedule_from_spec
from engine.train.step_runner import MicroBatchLoss, PipelineLoss, PipelineRunner, make_runner

if TYPE_CHECKING:
    from engine.train.reference_logps import ModelForward

log = logging.getLogger("engine.train")


@dataclasses.dataclass
class Plan:
    """Everything decided from the spec and the files before any work starts."""

    cfg: ModelConfig
    loaded: LoadedWeights | None
    dims: ParallelDims
    global_batch_size: int
    seq_length: int
    save: Path
    resume_from: Path | None
    resumed: owner.SavedRun | None = None  # the run under save this job continues (its own earlier attempt or not)


def _check_batch(spec: TrainSpec, dims: ParallelDims) -> int:
    gbs = spec.global_batch_size or spec.micro_batch_size * dims.dp
    if gbs % (spec.micro_batch_size * dims.dp):
        raise BadInput(
            f"global_batch_size: {gbs} is not divisible by micro_batch_size × DP ({spec.micro_batch_size} × {dims.dp}, "
            f"DP = world size {dims.world_size} / (TP {dims.tp} × PP {dims.pp} × CP {dims.cp}))",
            "global_batch_size",
        )
    return gbs


def _tokenizer_vocab(spec: TrainSpec) -> int | None:
    if not spec.tokenizer_name_or_path:
        return None
    from engine.data.tokenizer import load_tokenizer

    return len(load_tokenizer(spec.tokenizer_name_or_path))


def _model_config(spec: TrainSpec, dims: ParallelDims) -> tuple[ModelConfig, LoadedWeights | None]:
    check_model_kind(spec)
    if spec.load is None:
        return config_from_flags(spec, _tokenizer_vocab(spec)), None
    loaded = open_load(spec.load, rank_view(spec, dims))
    check_against_checkpoint(spec, loaded.config, f"{spec.load} ({loaded.format})")
    if loaded.format == "native" and loaded.meta and loaded.meta.get("trainable_only"):
        raise BadInput(
            f"load: {spec.load} holds LoRA adapters only; load their base model (the run's own load), "
            "or merge the run's final checkpoint with a convert job first",
            "load",
        )
    return with_spec_flags(spec, loaded.config), loaded


def plan_run(spec: TrainSpec, run: RunDir) -> Plan:
    """Validate the job against its files; BadInput (exit 2, no retry) for anything the user must fix."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp, ep = spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size, spec.expert_model_parallel_size
    try:
        dims = ParallelDims.from_world(
            world,
            tp,
            pp,
            ep,
            spec.context_parallel_size,
            spec.context_parallel_algo,
            spec.ulysses_degree_in_cp,
            spec.kv_head_repeat_before_uly_alltoall,
        )
    except LayoutError as err:
        raise BadInput(str(err), err.field) from err
    gbs = _check_batch(spec, dims)
    if spec.seq_length is None:
        raise BadInput("seq_length: required for training (the longest sample, in tokens)", "seq_length")
    if spec.lr_decay_style == "WSD":
        raise BadInput(
            "lr_decay_style: WSD is not supported; use constant, linear, cosine or inverse-square-root",
            "lr_decay_style",
        )
    check_data_paths(spec.data_path)
    cfg, loaded = _model_config(spec, dims)
    check_parallel_layout(spec, cfg, dims, gbs)
    if loaded is not None:  # the values the Spec tab marks "from the checkpoint" (those the user left unset)
        run.event(
            "config",
            f"model shape from the checkpoint {spec.load} ({loaded.format})",
            source="checkpoint",
            load=spec.load,
            format=loaded.format,
            values=checkpoint_flags(cfg, spec),
        )
    _warn_unsupported(spec, run)
    save = Path(spec.save) if spec.save else run.path / "checkpoints"
    resumed = _resume_point(spec, save)
    return Plan(cfg, loaded, dims, gbs, spec.seq_length, save, resumed.checkpoint if resumed else None, resumed)


def _resume_point(spec: TrainSpec, save: Path) -> owner.SavedRun | None:
    """The run under ``save`` to continue: always this job's own (a retry); another job's only with resume "auto"
    and iterations left to train (``core.admission`` refuses the rest at submission already; a race lands here)."""
    found = owner.saved_run(save)
    if found is None:
        return None
    me = owner.job_identity()
    if owner.is_own(found, me):
        return found
    if me is not None and spec.resume != "auto":
        raise BadInput(
            f"save: {save} already holds the run of {owner.describe(found)} at iteration {found.iteration}; "
            'set resume: "auto" to continue it, or give a new save',
            "save",
        )
    if found.iteration >= spec.train_iters:
        raise BadInput(
            f"train_iters: the run under save ({owner.describe(found)}) is already at iteration {found.iteration}, "
            f"so train_iters {spec.train_iters} leaves nothing to train; raise train_iters to continue it",
            "train_iters",
        )
    return found


def _warn_unsupported(spec: TrainSpec, run: RunDir) -> None:
    """Flags that are accepted but change nothing here: said once, in the log and the event stream."""
    notes = []
    for flag in ("hidden_dropout", "attention_dropout"):
        if getattr(spec, flag) > 0 and flag in spec.model_fields_set:
            notes.append(f"{flag}: the Qwen3 model here has no dropout; the value is ignored")
    for note in notes:
        log.warning("%s", note)
        run.event("warning", note)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(
        self, spec: TrainSpec, run: RunDir, plan: Plan, device: Device, stage_loss: MicroBatchLoss | None = None
    ):
        # stage_loss: a stage's own micro-batch loss handed in by ``engine.train.entry`` (stage grpo's), so this
        # module names no stage loop built on it (no import circle with engine.train.grpo)
        self.spec, self.run, self.plan, self.device = spec, run, plan, device
        self.stage_loss = stage_loss
        self.lora = spec.is_lora
        self.dtype = compute_dtype(spec)
        self.state = TrainState()
        self.step_metrics: dict[int, dict[str, float]] = {}  # iteration -> lm_loss / val_lm_loss, for checkpoints
        self.pass_reference: ModelForward | None = None  # the reference for fit's precompute pass (not under PP)
        self.precompute_pending = False
        self.reference_tables: dict[str, Any] = {}
        self.mesh = build_mesh(device, plan.dims)
        _seed_everything(spec.seed)
        self.model = self._build_model()
        self.runner = make_runner(
            self.model, self.mesh, device.torch_device, spec.cross_entropy_chunk_size, *self._preference_losses()
        )
        pp = self.mesh["pp"]
        self.router = RouterTracker(
            self.model, self.runner.dp_group, pp.get_group() if pp.size() > 1 else None, plan.dims.cp
        )
        self.optimizer = build_optimizer(self.model, spec)
        self.scheduler = Scheduler(self.optimizer, schedule_from_spec(spec))
        self.scaler = LossScaler(spec)
        self.resumed_from = self._restore()

    # -- setup

    def _build_model(self) -> torch.nn.Module:
        """This rank's part, meta-built and parallelized, filled with its slices of ``load`` or of the seeded initial
        weights; weights a DCP checkpoint restores next (``_restore``) are left unfilled."""
        spec, plan = self.spec, self.plan
        loaded, resuming = plan.loaded, plan.resume_from is not None
        if resuming and not self.lora or loaded is not None and loaded.format == "native":
            base: WeightSource | None = None  # every weight comes from the training checkpoint in _restore
        elif loaded is not None:
            base = loaded.source
        else:
            base = SeededInit(plan.cfg, spec.seed)
        return build_rank_model(
            plan.cfg, self.mesh, spec, plan.global_batch_size, plan.seq_length, self.device.torch_device, base
        )

    def _preference_losses(self) -> tuple[MicroBatchLoss | None, PipelineLoss | None]:
        """Stage dpo's loss, per micro-batch or on a pipeline's last stage, with its reference built here (Nones:
        the LM loss). Under PP the reference is precomputed (from the policy's own pipeline before its first step)
        or there is none (simpo, orpo): the spec refuses the rest."""
        if self.stage_loss is not None:
            return self.stage_loss, None
        if self.spec.stage != "dpo":
            return None, None
        from engine.train.dpo import PipelineDPOLoss, build_reference, dpo_loss, preference_config
        from engine.train.reference_logps import ModelForward

        plan, spec, chunk = self.plan, self.spec, self.spec.cross_entropy_chunk_size
        self.precompute_pending = spec.precompute_ref_log_probs
        if self.mesh["pp"].size() > 1:
            return None, PipelineDPOLoss(preference_config(spec), chunk, self._context_group())
        ref = build_reference(
            self.spec,
            plan.cfg,
            self.mesh,
            self.model,
            plan.global_batch_size,
            plan.seq_length,
            self.device.torch_device,
        )
        vocab_parallel = self.mesh["tp"].size() > 1
        if spec.precompute_ref_log_probs and ref is not None:  # used once by fit's pass, then dropped
            self.pass_reference, ref = ModelForward(ref, chunk), None
        return dpo_loss(preference_config(spec), ref, chunk, vocab_parallel), None

    def _precompute_reference(self, data: TrainData) -> None:
        """Every pair's reference log-probs into ``data`` (stored or reused), then the reference is freed."""
        from engine.train.reference_logps import Forward, PipelineForward, precompute

        plan, device = self.plan, self.device.torch_device
        forward: Forward | None = self.pass_reference
        if isinstance(self.runner, PipelineRunner) and self.resumed_from is None:  # still the starting weights
            micro_batches = plan.global_batch_size // (self.spec.micro_batch_size * plan.dims.dp)
            chunk = self.spec.cross_entropy_chunk_size
            forward = PipelineForward(self.runner, micro_batches, chunk, self._context_group())
        self.reference_tables = precompute(
            forward, data, self.spec, plan.cfg, plan.seq_length, self.mesh, self.run, device, self._context_shards
        )
        self.pass_reference, self.precompute_pending = None, False
        gc.collect()
        self.device.empty_cache()

    def _restore(self) -> str | None:
        spec, plan = self.spec, self.plan
        if plan.resume_from is not None:
            meta = dcp.load(plan.resume_from, self.model, self.optimizer, trainable_only=self.lora)
            self._restore_progress(meta)
            log.info("resumed from %s at iteration %d", plan.resume_from, self.state.iteration)
            return str(plan.resume_from)
        if plan.loaded is not None and plan.loaded.format == "native":
            assert spec.load is not None and plan.loaded.meta is not None  # a native load always has both
            keep_going = not spec.finetune
            optimizer = self.optimizer if keep_going and not spec.no_load_optim else None
            meta = dcp.load(
                spec.load,
                self.model,
                optimizer,
                trainable_only=bool(plan.loaded.meta.get("trainable_only")),
                load_rng=keep_going and not spec.no_load_rng,
            )
            if keep_going:
                self._restore_progress(meta)
        return None

    def _restore_progress(self, meta: dict[str, Any]) -> None:
        self.state = TrainState(meta["iteration"], meta["consumed_samples"], meta.get("skipped_iterations", 0))
        self.scheduler.load_state_dict(meta["scheduler"])
        self.scaler.load_state_dict(meta["loss_scaler"])

    def _resumed_job(self) -> str | None:
        """The other job whose run this one continued (resume "auto"); None for a fresh run or a retry."""
        found = self.plan.resumed
        return None if found is None or owner.is_own(found, owner.job_identity()) else found.job_id or "unknown"

    def _claim_save(self) -> None:
        """Record this job as the writer of save (rank 0), and say loudly when it continues another job's run."""
        found, me = self.plan.resumed, owner.job_identity()
        if found is not None:
            own = owner.is_own(found, me)
            message = (
                f"resumed this job's own checkpoint at iteration {found.iteration} (an earlier attempt)"
                if own
                else f"resumed from {owner.describe(found)} at iteration {found.iteration} (resume: auto)"
            )
            self.run.event(
                "resumed", message, resumed_from=str(found.checkpoint), job_id=found.job_id, iteration=found.iteration
            )
            if own:
                return
        if dist.get_rank() == 0:
            owner.claim(self.plan.save, me, self.spec.name, found)

    def _zero_steps_warning(self, start: int) -> list[str]:
        """A run with nothing left to train (a retry whose earlier attempt finished its steps) still succeeds, but
        says so: never a plain success with 0 steps. Another job's finished run is refused in plan_run."""
        if start < self.spec.train_iters:
            return []
        note = (
            f"trained 0 iterations: the checkpoint under save is already at iteration {start} "
            f"(train_iters {self.spec.train_iters}); the outputs are that run's weights"
        )
        log.warning("%s", note)
        self.run.event("warning", note, trained_iterations=0)
        return [note]

    def _run_summary(self, start: int, warnings: list[str]) -> dict[str, Any]:
        """What every stage's result says of its run: the iterations (and what it resumed), the load, the world."""
        plan = self.plan
        return {
            "iterations": self.state.iteration,
            "start_iteration": start,
            "consumed_samples": self.state.consumed_samples,
            "resumed_from": self.resumed_from,
            "resumed_from_job": self._resumed_job(),
            "trained_iterations": self.state.iteration - start,
            **({"warnings": warnings} if warnings else {}),
            "load_format": plan.loaded.format if plan.loaded else None,
            "world_size": plan.dims.world_size,
            "global_batch_size": plan.global_batch_size,
            "lora": self.lora,
        }

    # -- loop

    def _batches(self, data: TrainData, iteration: int) -> list[MicroBatch]:
        from engine.train.data import rank_micro_batches

        spec = self.spec
        groups = rank_micro_batches(
            data,
            iteration,
            self.plan.global_batch_size,
            spec.micro_batch_size,
            self.plan.dims.dp,
            self.mesh["dp"].get_local_rank(),
        )
        if spec.stage == "dpo":
            batches = [collate_pairs(g, self.plan.seq_length, spec.variable_seq_lengths) for g in groups]
        else:
            batches = [collate(g, self.plan.seq_length, spec.padding_free, spec.variable_seq_lengths) for g in groups]
        self._check_planned(batches, data, iteration)
        batches = self._context_shards(batches)
        vocab = self.plan.cfg.vocab_size
        for mb in batches:
            top = int(mb.input_ids.max())
            if top >= vocab:
                raise BadInput(f"data_path: token id {top} is outside the model's vocabulary ({vocab})", "data_path")
        return batches

    def _context_group(self) -> dist.ProcessGroup | None:
        cp = context_mesh(self.mesh)
        return None if cp is None else cp.get_group()

    def _context_shards(self, batches: list[MicroBatch]) -> list[MicroBatch]:
        """Under context parallelism each CP rank's slice of every row (whole micro-batches otherwise)."""
        if (cp := context_mesh(self.mesh)) is None:
            return batches
        ring, ulysses = self.plan.dims.ring_degree, self.plan.dims.ulysses_degree
        width = None if self.plan.dims.pp == 1 else context_pipeline_width(batches, ring, ulysses)
        return [context_shard(mb, ring, ulysses, cp.get_local_rank(), width) for mb in batches]

    def _check_planned(self, batches: list[MicroBatch], data: TrainData, iteration: int) -> None:
        """A micro-batch larger than the one admission planned on (``max_micro_batch_tokens``) is the data having
        changed since submission: a clear error naming its samples, never an out-of-memory."""
        limit, spec = self.spec.max_micro_batch_tokens, self.spec
        for m, mb in enumerate(batches):
            if limit is None or mb.input_ids.numel() <= limit:
                continue
            positions = rank_positions(
                iteration,
                self.plan.global_batch_size,
                spec.micro_batch_size,
                self.plan.dims.dp,
                self.mesh["dp"].get_local_rank(),
            )[m]
            rows = [data.start + data.order.index_at(k) for k in positions]
            raise BadInput(
                f"data_path: iteration {iteration}, micro-batch {m} (dataset rows {rows}) pads to "
                f"{tuple(mb.input_ids.shape)} = {mb.input_ids.numel()} token positions, over the {limit} the job was "
                "admitted with (max_micro_batch_tokens, the memory plan's largest micro-batch of the data at "
                "submission): the data changed since; resubmit to plan on it as it is now",
                "data_path",
            )

    def _save(self, iteration: int) -> None:
        spec = self.spec
        meta = {
            "consumed_samples": self.state.consumed_samples,
            "skipped_iterations": self.state.skipped_iterations,
            "scheduler": self.scheduler.state_dict(),
            "loss_scaler": self.scaler.state_dict(),
            "model_config": dataclasses.asdict(self.plan.cfg),
            "trainable_only": self.lora,
            "lora": {"r": spec.lora_r, "alpha": spec.lora_alpha, "targets": list(spec.lora_target_modules)}
            if self.lora
            else None,
            "load": spec.load,
            "global_batch_size": self.plan.global_batch_size,
            "world_size": self.plan.dims.world_size,
            "metrics": self.step_metrics.pop(iteration, {}),  # what keep_best_by compares
        }
        optimizer = None if spec.no_save_optim else self.optimizer
        if spec.save:
            check_output("save", spec.save)  # right before writing (engine.contract.guard)
        path = dcp.save(
            self.plan.save,
            iteration,
            self.runner.module,
            optimizer,
            meta,
            trainable_only=self.lora,
            save_rng=not spec.no_save_rng,
        )
        self.run.event(
            "checkpoint", f"saved training checkpoint at iteration {iteration}", iteration=iteration, path=str(path)
        )
        if spec.keep_last_n is not None and dist.get_rank() == 0:  # after the save is complete and tracked
            removed = dcp.prune(self.plan.save, iteration, spec.keep_last_n, spec.keep_best_by)
            if removed:
                log.info("retention: removed training checkpoints at iterations %s", removed)

    def _note_step(self, iteration: int, name: str, value: float) -> None:
        """Remember a finite step metric for the checkpoint of this iteration (saved iterations only)."""
        if self.spec.save_interval and iteration % self.spec.save_interval == 0 and math.isfinite(value):
            self.step_metrics.setdefault(iteration, {})[name] = value

    def _validate(self, valid: TrainData, iteration: int, metrics: MetricsLogger) -> None:
        """Loss over the validation share: the same first ``eval_iters`` global batches each time (fewer when the
        share is smaller: ceil(samples / global batch), the last one wrapping round), so passes compare."""
        spec, started = self.spec, time.perf_counter()
        batches = min(spec.eval_iters, -(-valid.num_samples // self.plan.global_batch_size))
        total = torch.zeros(2, dtype=torch.float64, device=self.device.torch_device)
        stats: dict[str, float] = {}
        self.runner.module.eval()
        with torch.no_grad():
            for j in range(1, batches + 1):
                sums, named = eval_step(self.runner, self._batches(valid, j))
                total += sums
                for name, value in named.items():
                    stats[name] = stats.get(name, 0.0) + float(value)
        self.runner.module.train()
        self.router.discard()  # validation forwards are not a training step's routing
        loss_sum, tokens = total.tolist()
        row = metrics.validation(iteration, loss_sum, tokens, time.perf_counter() - started, stats)
        self._note_step(iteration, "val_lm_loss", row["val_lm_loss"])

    def fit(self) -> tuple[dict[str, str], dict[str, Any]]:
        spec, plan = self.spec, self.plan
        data = TrainData.open(spec.data_path, spec.split, spec.seed, plan.seq_length, pairwise=spec.is_pairwise_dataset)
        valid = data.validation(spec.split) if spec.eval_iters > 0 else None
        if self.precompute_pending:
            self._precompute_reference(data)
        metrics = MetricsLogger(
            self.run,
            plan.cfg,
            self.device,
            spec.train_iters,
            plan.global_batch_size,
            spec.log_interval,
            spec.tensorboard_dir,
            self.lora,
            list(self.router.layers),
        )
        start = self.state.iteration
        self._claim_save()
        stop_on_usr2 = preempt.install()  # Slurm's warning before a time limit or preemption (engine.train.preempt)
        warnings = self._zero_steps_warning(start)
        self.runner.module.train()
        for iteration in range(start + 1, spec.train_iters + 1):
            started = time.perf_counter()
            batches = self._batches(data, iteration)
            record = train_step(
                self.runner,
                self.optimizer,
                self.scheduler,
                self.scaler,
                batches,
                self.state,
                global_batch_size=plan.global_batch_size,
                clip_grad=spec.clip_grad,
                router=self.router,
            )
            record.elapsed_s = time.perf_counter() - started  # Megatron's iteration time includes getting the batch
            metrics.record(record)
            if spec.save_interval and iteration % spec.save_interval == 0:  # one host sync per checkpoint
                labelled = float(record.counts[0])
                self._note_step(iteration, "lm_loss", float(record.loss_sum) / labelled if labelled else math.nan)
            if iteration % spec.log_interval == 0:
                self.run.progress(iteration, spec.train_iters, "iterations")
            if valid is not None and (iteration % spec.eval_interval == 0 or iteration == spec.train_iters):
                self._validate(valid, iteration, metrics)  # as Megatron: every eval_interval and at the end
            if spec.save_interval and iteration % spec.save_interval == 0:
                self._save(iteration)
            if stop_on_usr2 and preempt.asked(self.device.torch_device):
                if not (spec.save_interval and iteration % spec.save_interval == 0):
                    self._save(iteration)
                metrics.close()
                raise preempt.Preempted(iteration)
        metrics.close()
        if spec.save:
            check_output("save", spec.save)
        outputs = export_final(self.runner, self.mesh, plan.cfg, spec, plan.save, self.state.iteration, self.dtype)
        if spec.tensorboard_dir:
            outputs["tensorboard"] = spec.tensorboard_dir
        summary = {
            **self._run_summary(start, warnings),
            "parallel": {
                "dp": plan.dims.dp,
                "cp": plan.dims.cp,
                "cp_algo": plan.dims.cp_algo if plan.dims.cp > 1 else None,
                "pp": plan.dims.pp,
                "tp": plan.dims.tp,
            },
            "validation_samples": valid.num_samples if valid else 0,
            **({"reference_logps": self.reference_tables} if self.reference_tables else {}),
            **metrics.summary(),
        }
        return outputs, summary
