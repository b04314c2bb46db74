"""Stage grpo: online RL with rule rewards (TRL's ``GRPOTrainer``), on one process or under DP, TP, PP, EP and CP.

Iteration ``i`` is one optimizer step (TRL's step). Every ``num_iterations`` (μ) iterations a rollout samples
``num_generations`` completions for each of ``global_batch_size / num_generations`` prompts (the data order's next
ones) with the policy's current weights (``engine.train.grpo_rollout``), scores them (``engine.train.rewards``),
computes group advantages, and, when μ > 1, the old policy's per-token log-probs (one no-grad forward of the same
micro-batches, so the first pass's ratio is exactly 1), and when β > 0 the reference's (``engine.train.dpo``'s
reference: a frozen copy, or a LoRA policy's base with the adapters off). The μ steps then train on that rollout.

The loss (``engine.train.grpo_loss``): per-token log-probs of the tempered distribution (logits / temperature, as
TRL), through the chunked head (never tokens × vocabulary at once); each micro-batch's numerator summed, divided by
the global batch's denominator for ``loss_type`` before backward. Reported (TRL's names): ``lm_loss`` is the loss,
``kl``, ``entropy``, ``clip_ratio/*`` token means over the step, the rollout's ``reward``, ``reward_std``,
``rewards/<f>/mean|std``, ``frac_reward_zero_std`` and ``completions/*``. Every completion is kept in
``completions.jsonl`` in the run directory (one row each, written when its rollout is made).

Data parallel (FSDP2 as training lays it out): each DP rank samples and scores its share of the rollout's prompts
(whole groups, each group with its own generator: the token ids one process would sample), the ranks' completions
and rewards are gathered so every rank computes every advantage (``scale_rewards`` batch too), the rollout's metrics
and ``loss_type``'s denominator over the whole batch, then each rank trains on its own rows; FSDP sums the
gradients, so the step equals one process's. Tensor parallel (sequence parallel too): every TP rank decodes the same
rows on its shard of the policy (``engine.train.grpo_rollout``), and the log-probs and entropies go through the
vocab-parallel head (``engine.parallel.tensor_parallel``), the same figures on every TP rank. Pipeline parallel:
decoding runs stage to stage (``engine.train.grpo_rollout``), the loss and the old/reference passes on the last
stage through the schedule (``engine.train.grpo_pipeline``). Context parallel: every CP rank of a DP group decodes
the group's rows whole, CP's attention set aside (``engine.parallel.context_parallel.whole_sequences``: the same
weights, rows and generators, so the same tokens; CP rank 0's are kept on all), then each rank trains on its share of
every row (``engine.train.grpo_tokens.grpo_context_shard``, cut before the old and reference passes): its numerator
uses the whole sequences' token counts, so the CP ranks' numerators and gradients (summed over DP × CP) add up to
the micro-batch's.

Resume: checkpoints fall between rollouts (the spec holds save_interval to multiples of μ) and the sampler is seeded
by (seed, rollout), so a resumed run repeats the rollout it would have made; completions.jsonl drops the rows of
iterations after the checkpoint it resumed from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from engine.contract.constants import IGNORE_INDEX
from engine.contract.guard import check_output
from engine.contract.runfiles import BadInput
from engine.parallel.context_parallel import whole_sequences
from engine.parallel.data_parallel import reshard_all
from engine.parallel.expert_parallel import reduce_over_context
from engine.parallel.mesh import context_mesh
from engine.parallel.pipeline_parallel import PipelineModel
from engine.train.batches import MicroBatch, Sample, collate
from engine.train.data import TrainData
from engine.train.export import export_final
from engine.train.grpo_loss import denominator, group_advantages, group_std_is_zero
from engine.train.grpo_pipeline import PipelineGRPOLoss, TokenLogps
from engine.train.grpo_rollout import (
    Decoded,
    DecodeOptions,
    Prompt,
    decode,
    group_generator,
    prompt_of,
    stop_ids,
)
from engine.train.grpo_sampling import Sampling
from engine.train.grpo_tokens import GRPOMicroBatch, grpo_context_shard, token_logps
from engine.train.metrics import PER, MetricsLogger, StepRecord
from engine.train.optim import clip_grads
from engine.train.rewards import Completion, build_rewards, json_rewards, score
from engine.train.step_runner import PipelineRunner

if TYPE_CHECKING:
    from engine.train.dpo import Reference
    from engine.train.job import Trainer

COMPLETIONS = "completions.jsonl"


@dataclasses.dataclass
class Scored:
    """Completions (token ids up to and including the stop token), whether each was cut, their texts, their
    (completions × functions) rewards and the failed scorings per function: one DP rank's share, or the rollout's."""

    completions: list[list[int]]
    truncated: list[bool]
    texts: list[str]
    values: list[list[float]]
    failures: dict[str, int]


@dataclasses.dataclass
class Rollout:
    """One batch of completions and everything the μ steps on it need."""

    index: int
    batches: list[GRPOMicroBatch]
    denominator: float
    real_tokens: float
    sum_sq_len: float
    stats: dict[str, float]


def _nanstd(values: list[float]) -> float:
    """TRL's nanstd: the Bessel-corrected std of the scored values (NaN: an http reward's failed batch)."""
    column = torch.tensor(values, dtype=torch.float64)
    kept = column[~column.isnan()]
    return float(kept.std()) if kept.numel() > 1 else float("nan")


class GRPOLoop:
    """Stage grpo's ``fit`` over a built ``Trainer`` (its model, runner, optimizer, schedule and checkpoints)."""

    def __init__(self, trainer: Trainer) -> None:
        from engine.train.dpo import build_reference

        self.t, spec = trainer, trainer.spec
        self.spec = spec
        self.tokenizer = self._tokenizer()
        self.stop_ids = stop_ids(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else min(self.stop_ids)
        self.rewards = build_rewards(spec.reward_funcs, spec.max_completion_length)
        self.weights = spec.reward_weights or [1.0] * len(self.rewards)
        self.group = spec.num_generations
        self.prompts_per_step = trainer.plan.global_batch_size // self.group
        self.reference: Reference | None = None
        if spec.beta != 0.0:
            plan = trainer.plan
            self.reference = build_reference(
                spec, plan.cfg, trainer.mesh, trainer.model, plan.global_batch_size, plan.seq_length,
                trainer.device.torch_device,
            )  # fmt: skip
        # pipeline parallel: the loss on the last stage, and forward-only schedules for the old and reference passes
        self.pipeline_loss = PipelineGRPOLoss(spec)
        self.pipeline_logps = TokenLogps(spec)
        self.reference_runner: PipelineRunner | None = None
        if isinstance(trainer.runner, PipelineRunner) and self.reference and not self.reference.adapters_off:
            self.reference_runner = PipelineRunner(cast(PipelineModel, self.reference.module), trainer.mesh)
        dims = trainer.plan.dims
        self.dp, self.dp_rank = dims.dp, trainer.mesh["dp"].get_local_rank()
        self.dp_group = trainer.mesh["dp"].get_group()
        self.cp = context_mesh(trainer.mesh)
        if self.prompts_per_step % self.dp:
            raise BadInput(
                f"global_batch_size: {self.prompts_per_step} prompts per step ({trainer.plan.global_batch_size} "
                f"completions / num_generations {self.group}) do not split over DP {self.dp} (a prompt's group is "
                "sampled and scored on one rank)",
                "global_batch_size",
            )
        sampling = Sampling(spec.temperature, spec.top_k or 0, spec.top_p)
        self.decoding = DecodeOptions(
            spec.max_completion_length, frozenset(self.stop_ids), self.pad_id, sampling, self.group,
            together=dims.world_size > 1, tp=dims.tp,
        )  # fmt: skip

    def _tokenizer(self) -> Any:
        from engine.data.tokenizer import load_tokenizer

        spec = self.spec
        path = spec.tokenizer_name_or_path or spec.load
        if path is None:
            raise BadInput(
                "tokenizer_name_or_path: stage grpo decodes completions; give the tokenizer", "tokenizer_name_or_path"
            )
        try:
            return load_tokenizer(path, use_fast=not spec.tokenizer_not_use_fast)
        except (OSError, ValueError) as err:
            raise BadInput(f"tokenizer_name_or_path: no tokenizer at {path} ({err})", "tokenizer_name_or_path") from err

    # -- rollouts

    def _prompts(self, data: TrainData, rollout: int) -> list[Prompt]:
        first = rollout * self.prompts_per_step
        return [prompt_of(data, k, self.tokenizer) for k in range(first, first + self.prompts_per_step)]

    def make_rollout(self, data: TrainData, rollout: int, iteration: int) -> Rollout:
        t, spec, group = self.t, self.spec, self.group
        prompts = self._prompts(data, rollout)
        longest = max(len(p.ids) for p in prompts)
        if longest + spec.max_completion_length > t.plan.seq_length:
            raise BadInput(
                f"seq_length: a prompt of {longest} tokens and max_completion_length {spec.max_completion_length} "
                f"need {longest + spec.max_completion_length}, over seq_length {t.plan.seq_length}",
                "seq_length",
            )
        share = len(prompts) // self.dp
        first = self.dp_rank * share  # this DP rank's groups: prompts [first, first + share) of the rollout
        rows = [p for p in prompts[first : first + share] for _ in range(group)]
        device = t.device.torch_device
        opts = dataclasses.replace(self.decoding, width=longest)
        generators = [group_generator(spec.seed, rollout, first + k, device) for k in range(share)]
        model = t.runner.module
        model.eval()
        # CP: each CP rank decodes its DP group's rows whole, as a TP rank does (PP with CP is refused at submission)
        with contextlib.nullcontext() if isinstance(model, PipelineModel) else whole_sequences(model):
            decoded = self._same_on_context_ranks(decode(model, t.plan.cfg, [p.ids for p in rows], opts, generators))
        reshard_all(model.pipeline.parts if isinstance(model, PipelineModel) else [model])
        model.train()
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in decoded.completions]
        prompt_texts = {p.index: self.tokenizer.decode(p.ids) for p in rows}  # as the model saw it (http rewards)
        completions = [
            Completion(text, len(ids), cut, p.reference, prompt_texts[p.index])
            for text, ids, cut, p in zip(texts, decoded.completions, decoded.truncated, rows, strict=True)
        ]
        scores = score(self.rewards, completions)  # each DP rank scores its own share (http rewards: one request)
        mine = Scored(decoded.completions, decoded.truncated, texts, scores.values, scores.failures)
        whole = self._gather(mine)
        all_rows = [p for p in prompts for _ in range(group)]
        per_func = torch.tensor(whole.values, dtype=torch.float32)
        # TRL's nansum: an unscored (NaN) reward adds nothing to the weighted sum
        rewards = (per_func * torch.tensor(self.weights, dtype=torch.float32)[None]).nansum(dim=1)
        advantages = group_advantages(rewards, group, spec.scale_rewards, spec.advantage_eps)
        own = advantages[first * group : (first + share) * group]
        batches = self._context_shards(self._micro_batches(rows, decoded.completions, decoded.truncated, own))
        self._old_and_reference(batches)
        self._write_completions(iteration, all_rows, whole, rewards, advantages)
        lengths = [len(c) for c in whole.completions]
        masked = [0.0 if (cut and spec.mask_truncated_completions) else 1.0 for cut in whole.truncated]
        tokens = sum(n * m for n, m in zip(lengths, masked, strict=True))
        stats = self._rollout_stats(rewards, per_func, lengths, whole.truncated, whole.failures)
        real = [len(p.ids) + len(c) - 1 for p, c in zip(all_rows, whole.completions, strict=True)]
        micro_batches = len(batches) * self.dp  # every DP rank holds as many
        denom = denominator(spec.loss_type, len(all_rows), micro_batches, tokens, spec.max_completion_length)
        return Rollout(rollout, batches, denom, float(sum(real)), float(sum(n * n for n in real)), stats)

    def _same_on_context_ranks(self, decoded: Decoded) -> Decoded:
        """Under CP, CP rank 0's completions on every CP rank of its group: the ranks decode the same rows with the
        same weights and generators, so they sample the same tokens; this makes it hold whatever the kernels'
        rounding, since the loss's sequence split needs every CP rank to cut the very same rows."""
        if self.cp is None:
            return decoded
        group = self.cp.get_group()
        box: list[Decoded | None] = [decoded]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return cast(Decoded, box[0])

    def _context_shards(self, batches: list[GRPOMicroBatch]) -> list[GRPOMicroBatch]:
        """Under CP this rank's share of every micro-batch's rows (``grpo_context_shard``); whole ones otherwise."""
        if self.cp is None:
            return batches
        dims, rank = self.t.plan.dims, self.cp.get_local_rank()
        return [grpo_context_shard(mb, dims.ring_degree, dims.ulysses_degree, rank) for mb in batches]

    def _gather(self, mine: Scored) -> Scored:
        """The whole rollout's completions and scores, in prompt order, from every DP rank's share."""
        if self.dp == 1:
            return mine
        parts: list[Scored | None] = [None] * self.dp
        dist.all_gather_object(parts, mine, group=self.dp_group)
        whole = Scored([], [], [], [], {key: 0 for key in mine.failures})
        for part in cast(list[Scored], parts):
            whole.completions += part.completions
            whole.truncated += part.truncated
            whole.texts += part.texts
            whole.values += part.values
            for key, n in part.failures.items():
                whole.failures[key] += n
        return whole

    def _micro_batches(
        self, rows: list[Prompt], completions: list[list[int]], truncated: list[bool], advantages: torch.Tensor
    ) -> list[GRPOMicroBatch]:
        spec, out = self.spec, []
        mbs = spec.micro_batch_size
        for first in range(0, len(rows), mbs):
            idx = range(first, min(first + mbs, len(rows)))
            samples = []
            for i in idx:
                ids = rows[i].ids + completions[i]
                labels = [IGNORE_INDEX] * len(rows[i].ids) + completions[i]
                samples.append(Sample(torch.tensor(ids).numpy(), torch.tensor(labels).numpy()))
            mb = collate(samples, self.t.plan.seq_length, spec.padding_free, spec.variable_seq_lengths)
            counts = torch.tensor([len(completions[i]) for i in idx])
            seq = torch.repeat_interleave(torch.arange(len(idx)), counts)
            if seq.numel() != mb.num_loss_tokens:
                raise RuntimeError("grpo: the micro-batch's labelled tokens are not its completions' tokens")
            keep = torch.tensor(
                [0.0 if (truncated[i] and spec.mask_truncated_completions) else 1.0 for i in idx], dtype=torch.float32
            )
            fields = {f.name: getattr(mb, f.name) for f in dataclasses.fields(MicroBatch)}
            g = GRPOMicroBatch(
                **fields, sequences=len(idx), token_seq=seq, advantages=advantages[list(idx)], mask=keep[seq],
                seq_tokens=keep * counts,
            )  # fmt: skip
            out.append(g)
        return out

    @torch.no_grad()
    def _old_and_reference(self, batches: list[GRPOMicroBatch]) -> None:
        """The old policy's token log-probs (μ > 1) and the reference's (β > 0), before the rollout's first step."""
        from engine.model.lora import adapters_disabled

        if isinstance(self.t.runner, PipelineRunner):
            self._old_and_reference_staged(self.t.runner, batches)
            return
        spec, device = self.spec, self.t.device.torch_device
        chunk = spec.cross_entropy_chunk_size
        for mb in batches:
            on = mb.to(device)
            if spec.num_iterations > 1:
                mb.old_logps = token_logps(self.t.runner.module, on, chunk, spec.temperature)[0].detach()
            if self.reference is not None:
                ref = self.reference
                if ref.adapters_off:
                    with adapters_disabled(ref.module):
                        logp = token_logps(ref.module, on, chunk, spec.temperature)[0]
                else:
                    logp = token_logps(ref.module, on, chunk, spec.temperature)[0]
                mb.ref_token_logps = logp.detach()
        # forward-only passes leave FSDP's kept-gathered groups gathered (``reshard_all``)
        reshard_all([self.t.runner.module] + ([self.reference.module] if self.reference is not None else []))

    def _old_and_reference_staged(self, runner: PipelineRunner, batches: list[GRPOMicroBatch]) -> None:
        """``_old_and_reference`` under PP: forward-only schedules, the log-probs kept on the last stage (the only
        one whose loss reads them)."""
        old = self.pipeline_logps(runner, batches) if self.spec.num_iterations > 1 else None
        ref = None
        if self.reference is not None and self.reference_runner is not None:
            ref = self.pipeline_logps(self.reference_runner, batches)
        elif self.reference is not None:  # LoRA: the policy's own pipeline with the adapters off
            ref = self.pipeline_logps(runner, batches, adapters_off=True)
        for i, mb in enumerate(batches):
            mb.old_logps = None if old is None else old[i]
            mb.ref_token_logps = None if ref is None else ref[i]

    def _rollout_stats(
        self,
        rewards: torch.Tensor,
        per_func: torch.Tensor,
        lengths: list[int],
        truncated: list[bool],
        failures: dict[str, int],
    ) -> dict[str, float]:
        spec = self.spec
        values = rewards.tolist()
        stats: dict[str, float] = {
            "reward": sum(values) / len(values),
            "reward_std": _nanstd(values),
            "frac_reward_zero_std": float(group_std_is_zero(rewards, self.group, spec.scale_rewards).float().mean()),
        }
        for j, r in enumerate(self.rewards):
            column = per_func[:, j].tolist()
            stats[f"rewards/{r.key}/mean"] = float(per_func[:, j].nanmean())  # TRL's nanmean
            stats[f"rewards/{r.key}/std"] = _nanstd(column)
            stats[f"rewards/{r.key}/failures"] = float(failures[r.key])
        done = [n for n, cut in zip(lengths, truncated, strict=True) if not cut]
        stats.update(
            {
                "completions/mean_length": sum(lengths) / len(lengths),
                "completions/min_length": float(min(lengths)),
                "completions/max_length": float(max(lengths)),
                "completions/clipped_ratio": sum(truncated) / len(truncated),
                "completions/mean_terminated_length": sum(done) / len(done) if done else 0.0,
                "completions/min_terminated_length": float(min(done)) if done else 0.0,
                "completions/max_terminated_length": float(max(done)) if done else 0.0,
            }
        )
        return stats

    def _write_completions(
        self, iteration: int, rows: list[Prompt], whole: Scored, rewards: torch.Tensor, advantages: torch.Tensor
    ) -> None:
        if not self.t.run.is_writer:
            return
        keys = [r.key for r in self.rewards]
        prompts = {p.index: self.tokenizer.decode(p.ids) for p in rows}  # as the model saw it, template included
        with open(self.t.run.path / COMPLETIONS, "a", encoding="utf-8") as f:
            for i, p in enumerate(rows):
                row = {
                    "iteration": iteration,
                    "prompt_id": p.index,
                    "prompt_ids": p.ids,
                    "prompt": prompts[p.index],
                    "completion_ids": whole.completions[i],
                    "completion": whole.texts[i],
                    "reward": float(rewards[i]),
                    "rewards": json_rewards(keys, whole.values[i]),
                    "advantage": float(advantages[i]),
                    "truncated": whole.truncated[i],
                }
                f.write(json.dumps(row) + "\n")

    def _trim_completions(self, start: int) -> None:
        """A resumed run drops the rows of iterations after its checkpoint (its earlier attempt's later rollouts)."""
        path = self.t.run.path / COMPLETIONS
        if not self.t.run.is_writer or not path.is_file():
            return
        lines = path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if json.loads(line)["iteration"] <= start]
        if len(kept) != len(lines):
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    # -- steps

    def step(self, rollout: Rollout) -> StepRecord:
        t = self.t
        started = time.perf_counter()
        params = [p for p in t.runner.module.parameters() if p.requires_grad]
        device = t.runner.device
        denom = torch.tensor(rollout.denominator, dtype=torch.float64, device=device)
        if t.router:  # MoE: one routed token's aux loss weighs as in SFT (loss scale / the batch's real tokens)
            t.router.set_token_weight(t.scaler.scale / max(rollout.real_tokens, 1.0))
        if isinstance(t.runner, PipelineRunner):
            with t.runner.using(self.pipeline_loss):
                losses = t.runner.forward_backward(rollout.batches, denom, t.scaler.scale)
        else:
            losses = t.runner.forward_backward(rollout.batches, denom, t.scaler.scale)
        reduce_over_context(t.runner.module)  # experts under EP × CP (``engine.train.loop.train_step``'s)
        t.router.discard()  # the rollout's decoding and this step's figures are not reported (dense: a no-op)
        if t.scaler.scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1.0 / t.scaler.scale)
        grad_norm = t.runner.grad_norm()
        skipped = not bool(torch.isfinite(grad_norm))
        if not skipped:
            clip_grads(params, t.spec.clip_grad, grad_norm)
            t.optimizer.step()
            t.scheduler.step()
        t.optimizer.zero_grad(set_to_none=True)
        t.scaler.update(skipped)
        losses = t.runner.reduce(losses)
        t.state.iteration += 1
        t.state.consumed_samples += t.plan.global_batch_size
        t.state.skipped_iterations += int(skipped)
        stats = dict(losses.stats)
        for name, value in rollout.stats.items():
            stats[name] = torch.tensor(value, device=device)
            stats[name + PER] = torch.ones((), device=device)
        counts = torch.tensor(
            [rollout.denominator, rollout.real_tokens, rollout.sum_sq_len], dtype=torch.float64, device=device
        )
        return StepRecord(
            iteration=t.state.iteration,
            loss_sum=losses.token_sum,
            counts=counts,
            grad_norm=grad_norm,
            skipped=skipped,
            lr=t.scheduler.lr,
            loss_scale=t.scaler.scale,
            elapsed_s=time.perf_counter() - started,
            consumed_samples=t.state.consumed_samples,
            stats=stats,
        )

    def fit(self) -> tuple[dict[str, str], dict[str, Any]]:
        t, spec, plan = self.t, self.spec, self.t.plan
        data = TrainData.open(spec.data_path, spec.split, spec.seed, plan.seq_length)
        metrics = MetricsLogger(
            t.run, plan.cfg, t.device, spec.train_iters, plan.global_batch_size, spec.log_interval,
            spec.tensorboard_dir, t.lora,
        )  # fmt: skip
        start = t.state.iteration
        if start % spec.num_iterations:
            raise BadInput(
                f"num_iterations: the checkpoint is at iteration {start}, inside a batch of {spec.num_iterations} "
                "steps on one rollout; resume from a checkpoint between rollouts",
                "num_iterations",
            )
        t._claim_save()
        warnings = t._zero_steps_warning(start)
        self._trim_completions(start)
        t.runner.module.train()
        rollout: Rollout | None = None
        for iteration in range(start + 1, spec.train_iters + 1):
            started = time.perf_counter()
            index = (iteration - 1) // spec.num_iterations
            if rollout is None or rollout.index != index:
                rollout = self.make_rollout(data, index, iteration)
            record = self.step(rollout)
            record.elapsed_s = time.perf_counter() - started
            metrics.record(record)
            if spec.save_interval and iteration % spec.save_interval == 0:
                t._note_step(iteration, "lm_loss", float(record.loss_sum) / rollout.denominator)
            if iteration % spec.log_interval == 0:
                t.run.progress(iteration, spec.train_iters, "iterations")
            if spec.save_interval and iteration % spec.save_interval == 0:
                t._save(iteration)
        metrics.close()
        if spec.save:
            check_output("save", spec.save)
        outputs = export_final(t.runner, t.mesh, plan.cfg, spec, plan.save, t.state.iteration, t.dtype)
        outputs["completions"] = str(t.run.path / COMPLETIONS)
        final = metrics.last
        summary = {
            **t._run_summary(start, warnings),
            "parallel": {
                "dp": plan.dims.dp,
                "tp": plan.dims.tp,
                "pp": plan.dims.pp,
                "ep": plan.dims.ep,
                "cp": plan.dims.cp,
            },
            "final_reward": final.get("reward"),
            **metrics.summary(),
        }
        return outputs, summary
