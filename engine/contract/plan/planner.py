"""Job spec -> per-rank memory plan, and the check that every rank fits its device (no torch: the API calls it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from engine.contract.constants import REFERENCE_FREE_LOSSES
from engine.contract.lora_targets import MEGATRON_TARGETS, resolve_targets
from engine.contract.model_config import ModelConfig
from engine.contract.plan.data_shape import BatchShape, largest_micro_batch
from engine.contract.plan.memory import (
    GIB,
    Layout,
    OptimizerBytes,
    RankMemory,
    kv_cache_bytes,
    plan_ranks,
)
from engine.contract.plan.shape import ShapeUnknown, model_config
from engine.contract.spec import EvalSpec, JobBase, ModelSpec, ServeSpec, TrainSpec


@dataclasses.dataclass
class MemoryPlan:
    """Every rank's memory at the worst case (``ranks``: every micro-batch at ``seq_length``) and, when the job's
    data could be read, with its largest micro-batch (``data``, ``data_ranks``): the figure admission decides on."""

    cfg: ModelConfig
    source: str
    layout: Layout
    ranks: list[RankMemory]
    device_memory_bytes: int | None = None
    data: BatchShape | None = None
    data_ranks: list[RankMemory] | None = None
    host_memory_bytes: int | None = None

    @property
    def peak(self) -> RankMemory:
        """The worst rank at the worst case."""
        return max(self.ranks, key=lambda r: r.total_bytes)

    @property
    def data_peak(self) -> RankMemory | None:
        """The worst rank on this job's data (None when the data was not read)."""
        return max(self.data_ranks, key=lambda r: r.total_bytes) if self.data_ranks else None

    @property
    def decisive(self) -> RankMemory:
        """What admission compares with the device: the data's figure when there is one, else the worst case."""
        return self.data_peak or self.peak

    def as_json(self) -> dict[str, Any]:
        lay, data_peak, cp = self.layout, self.data_peak, self.layout.dims.cp
        return {
            "ranks": [r.as_json(cp) for r in self.ranks],
            "max_total_bytes": self.decisive.total_bytes,
            "worst_case_bytes": self.peak.total_bytes,
            "this_data_bytes": None if data_peak is None else data_peak.total_bytes,
            "this_data_batch": None
            if self.data is None
            else {**dataclasses.asdict(self.data), "tokens": self.data.tokens},
            "this_data_ranks": None if self.data_ranks is None else [r.as_json(cp) for r in self.data_ranks],
            "device_memory_bytes": self.device_memory_bytes,
            "fits": None if self.device_memory_bytes is None else self.decisive.total_bytes <= self.device_memory_bytes,
            "host_bytes_per_node": node_host_bytes(self.ranks, lay),
            "host_memory_bytes": self.host_memory_bytes,
            "model_source": self.source,
            "model": dataclasses.asdict(self.cfg),
            "num_params": self.cfg.num_params(),
            "active_params": self.cfg.num_params(active=True),
            "layout": {
                "world_size": lay.dims.world_size,
                "tp": lay.dims.tp,
                "pp": lay.dims.pp,
                "dp": lay.dims.dp,
                "virtual_chunks": (len(self.ranks[0].layers) // max(1, lay.layers_per_virtual_stage or 0))
                if lay.layers_per_virtual_stage
                else 1,
                **_batch_json(lay),
                "seq_length": lay.seq_length,
                "compute_bytes": lay.compute_bytes,
                "distributed_optimizer": lay.distributed_optimizer,
                "recompute": lay.recompute,
                "lora_r": lay.lora_r,
                "device_type": lay.device_type,
                "train": lay.train,
            },
        }


PLANNED_KINDS = ("train", "eval", "serve")


class DoesNotFit(ValueError):
    """A rank's predicted peak exceeds the device memory; ``field`` is the spec field to change first."""

    def __init__(self, field: str, message: str, plan: MemoryPlan):
        super().__init__(f"{field}: {message}")
        self.field, self.plan = field, plan


def layout_from_spec(spec: ModelSpec, cfg: ModelConfig) -> Layout:
    """The planner's view of a TrainSpec/EvalSpec/ServeSpec (world size from ``resources``). A serve job is planned as
    eval with ``max_num_seqs`` rows of ``max_model_len`` cached positions, its activations those of one prefill chunk
    (spread over the rows)."""
    seq, dims = spec.seq_length or cfg.max_position_embeddings, spec.parallel_dims
    kind: dict[str, Any]
    if isinstance(spec, TrainSpec):
        kind = {
            "train": True,
            "micro_batch_size": spec.micro_batch_size,
            "recompute": spec.recompute,
            "recompute_method": spec.recompute_method,
            "recompute_num_layers": spec.recompute_num_layers,
            "lora_r": spec.lora_r,
            "lora_targets": tuple(resolve_targets(spec.lora_target_modules)) if spec.is_lora else MEGATRON_TARGETS,
            "loss_chunk": spec.cross_entropy_chunk_size,
            "optim": optimizer_bytes(spec),
            **_preference_layout(spec),
        }
    else:  # eval and serve run every expert on each rank
        dims = dataclasses.replace(dims, ep=1)
        if isinstance(spec, ServeSpec):
            seq = max(1, spec.max_num_batched_tokens // spec.max_num_seqs)
            kind = {"train": False, "max_num_seqs": spec.max_num_seqs, "eval_tokens": spec.max_model_len}
        else:
            kind = {"train": False, "micro_batch_size": spec.micro_batch_size, "eval_tokens": seq + spec.max_new_tokens}
    return Layout(
        dims=dims,
        nnodes=spec.resources.nnodes,
        global_batch_size=spec.effective_global_batch_size,
        seq_length=seq,
        compute_bytes=2 if (spec.bf16 or spec.fp16) else 4,
        distributed_optimizer=spec.use_distributed_optimizer,
        sequence_parallel=spec.sequence_parallel,
        num_layer_list=tuple(spec.num_layer_list) if spec.num_layer_list else None,
        layers_per_virtual_stage=spec.num_layers_per_virtual_pipeline_stage,
        device_type=spec.resources.device_type,
        **kind,
    )


def _batch_json(lay: Layout) -> dict[str, int]:
    """The plan's batch in the spec's own words: a serve job's ``max_num_seqs``, else the micro-batches."""
    if lay.max_num_seqs is not None:
        return {"max_num_seqs": lay.max_num_seqs}
    return {"micro_batch_size": lay.micro_batch_size, "micro_batches": lay.micro_batches}


def _batch_text(lay: Layout) -> str:
    """The batch for messages, in the spec's own words."""
    name, rows = (
        ("max_num_seqs", lay.max_num_seqs)
        if lay.max_num_seqs is not None
        else ("micro_batch_size", lay.micro_batch_size)
    )
    return f"{name} {rows}"


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def optimizer_bytes(spec: TrainSpec) -> OptimizerBytes:
    """The optimizer's storage of a training spec (4 B each without the precision-aware optimizer)."""
    if not spec.use_precision_aware_optimizer:
        return OptimizerBytes()
    return OptimizerBytes(
        main_grads=DTYPE_BYTES[spec.main_grads_dtype],
        main_params=DTYPE_BYTES[spec.main_params_dtype],
        exp_avg=DTYPE_BYTES[spec.exp_avg_dtype],
        exp_avg_sq=DTYPE_BYTES[spec.exp_avg_sq_dtype],
        offload=spec.optimizer_offload_fraction if spec.optimizer_cpu_offload else 0.0,
        precision_aware=True,
    )


def _preference_layout(spec: TrainSpec) -> dict[str, Any]:
    """Stage dpo: pairs double the rows of a micro-batch; a frozen reference copy unless LoRA, reference-free or
    precomputed (``precompute_ref_log_probs``: the copy lives only in the pass before training, while the policy has
    no gradients or optimizer state yet, so it never sets the peak). Stage grpo: each rank decodes its groups'
    completions at once (``generation_rows``), and beta != 0 keeps a frozen reference (none under LoRA)."""
    if spec.stage == "grpo":
        rows = spec.effective_global_batch_size // spec.parallel_dims.dp
        return {"generation_rows": rows, "reference_copy": spec.beta != 0 and not spec.is_lora}
    if spec.stage != "dpo":
        return {}
    free = spec.dpo_loss_type in REFERENCE_FREE_LOSSES
    copy = not spec.is_lora and not free and not spec.precompute_ref_log_probs
    return {"rows_per_sample": 2, "reference_copy": copy}


def plan_spec(spec: ModelSpec, model: str | None = None, device_memory_bytes: int | None = None) -> MemoryPlan:
    """Predicted per-rank memory of a train, eval or serve spec. Raises ``ShapeUnknown`` when the shape cannot be
    found."""
    if spec.kind not in PLANNED_KINDS:
        raise ValueError(f"kind: only train, eval and serve jobs have a memory plan, not {spec.kind!r}")
    cfg, source = model_config(spec, model)
    lay = layout_from_spec(spec, cfg)
    plan = MemoryPlan(cfg, source, lay, plan_ranks(cfg, lay), device_memory_bytes)
    if isinstance(spec, TrainSpec):
        plan.data = largest_micro_batch(spec, spec.effective_global_batch_size, lay.seq_length)
    if plan.data is not None:
        sized = dataclasses.replace(lay, batch_rows=plan.data.rows, batch_width=plan.data.width)
        plan.data_ranks = plan_ranks(cfg, sized)
    return plan


def node_host_bytes(ranks: list[RankMemory], lay: Layout) -> int:
    """The most host memory one node's ranks take (offloaded optimizer state; a node holds consecutive ranks)."""
    per_node = max(1, lay.dims.world_size // max(1, lay.nnodes))
    return max((sum(r.host for r in ranks[i : i + per_node]) for i in range(0, len(ranks), per_node)), default=0)


def check_host_fits(plan: MemoryPlan, host_memory_bytes: int) -> None:
    """``DoesNotFit`` naming optimizer_offload_fraction when one node's offloaded optimizer state exceeds its RAM."""
    need = node_host_bytes(plan.ranks, plan.layout)
    if need <= host_memory_bytes:
        return
    opt = plan.layout.optim
    raise DoesNotFit(
        "optimizer_offload_fraction",
        f"the offloaded optimizer state of one node's ranks needs {_gib(need)} of host memory (offload fraction "
        f"{opt.offload}, {opt.host_bytes()} B per offloaded parameter), but a host has {_gib(host_memory_bytes)}; "
        "lower optimizer_offload_fraction, use bf16 moments (exp_avg_dtype, exp_avg_sq_dtype) or more nodes",
        plan,
    )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def breakdown(r: RankMemory) -> str:
    """One line: the rank's parts, for error messages."""
    parts = [
        ("params", r.params),
        ("main params", r.main_params),
        ("grads", r.grads),
        ("optimizer", r.optimizer),
        ("activations", r.activations),
        ("loss", r.loss),
        ("comm", r.comm),
        ("reference model", r.reference),
        ("optimizer step", r.optimizer_step),
        ("generation", r.generation),
    ]
    return ", ".join(f"{name} {_gib(v)}" for name, v in parts if v)


def _check_kv_share(spec: ServeSpec, plan: MemoryPlan, device_memory_bytes: int) -> None:
    """A serve job's KV cache must fit in ``kv_cache_memory_fraction`` of what the weights leave of the device."""
    fraction = spec.kv_cache_memory_fraction
    worst = plan.peak
    kv = kv_cache_bytes(plan.cfg, plan.layout, len(worst.layers))
    room = max(0, device_memory_bytes - worst.params)
    if fraction is None or kv <= fraction * room:
        return
    raise DoesNotFit(
        "max_num_seqs",
        f"the KV cache of {spec.max_num_seqs} sequences × {spec.max_model_len} tokens needs {_gib(kv)}, over "
        f"kv_cache_memory_fraction {fraction} of the {_gib(room)} the weights ({_gib(worst.params)}) leave of a "
        f"{_gib(device_memory_bytes)} device; lower max_num_seqs or max_model_len",
        plan,
    )


def _figures(plan: MemoryPlan) -> str:
    """Both figures of the decisive rank: on this data (when read) and at the worst case."""
    worst, lay = plan.peak, plan.layout
    at_worst = f"{_gib(worst.total_bytes)} at the worst case (every micro-batch at seq_length {lay.seq_length})"
    if plan.data is None or plan.data_peak is None:
        return at_worst
    return (
        f"{_gib(plan.data_peak.total_bytes)} on this data (its largest micro-batch: {plan.data.describe()}), {at_worst}"
    )


def _remedies(plan: MemoryPlan, spec: TrainSpec, device_memory_bytes: int) -> list[str]:
    """Single changes that would make the job fit, each with its new peak: recompute, then smaller micro-batches
    (planned at their worst case, so what is offered surely fits; the global batch the spec would then have)."""
    lay = plan.layout
    sized = dataclasses.replace(lay, batch_rows=plan.data.rows, batch_width=plan.data.width) if plan.data else lay
    tries: list[tuple[str, Layout]] = []
    if lay.reference_copy:  # stage dpo: the reference's log-probs computed once, before training
        tries.append(("precompute_ref_log_probs true", dataclasses.replace(sized, reference_copy=False)))
    for mode in ("selective", "full"):
        if lay.recompute != mode and not (mode == "selective" and lay.recompute == "full"):
            tries.append((f"recompute_granularity {mode}", dataclasses.replace(sized, recompute=mode)))
    if lay.compute_bytes == 2 and lay.lora_r is None and not lay.optim.precision_aware:
        aware = "use_precision_aware_optimizer with exp_avg_dtype/exp_avg_sq_dtype bf16"
        options = {
            aware: OptimizerBytes(exp_avg=2, exp_avg_sq=2, precision_aware=True),
            aware + " and main_grads_dtype bf16": OptimizerBytes(2, 4, 2, 2, precision_aware=True),
            aware + ", optimizer_cpu_offload": OptimizerBytes(4, 4, 2, 2, offload=1.0, precision_aware=True),
        }
        tries += [(label, dataclasses.replace(sized, optim=optim)) for label, optim in options.items()]
    mbs = lay.micro_batch_size // 2
    while mbs >= 1:
        gbs = spec.model_copy(update={"micro_batch_size": mbs}).effective_global_batch_size
        tries.append((f"micro_batch_size {mbs}", dataclasses.replace(lay, micro_batch_size=mbs, global_batch_size=gbs)))
        mbs //= 2
    out = []
    for label, tried in tries:
        peak = max(r.total_bytes for r in plan_ranks(plan.cfg, tried))
        if peak <= device_memory_bytes:
            out.append(f"{label} ({_gib(peak)})")
    return out


def check_fits(
    spec: ModelSpec, device_memory_bytes: int, model: str | None = None, host_memory_bytes: int | None = None
) -> MemoryPlan:
    """The plan, or ``DoesNotFit`` naming what to change when the decisive rank (on this job's data when it could be
    read, else at the worst case) exceeds ``device_memory_bytes``, or one node's offloaded optimizer state exceeds
    ``host_memory_bytes`` (when given)."""
    plan = plan_spec(spec, model, device_memory_bytes)
    plan.host_memory_bytes = host_memory_bytes
    if host_memory_bytes is not None:
        check_host_fits(plan, host_memory_bytes)
    worst = plan.decisive
    if spec.kind == "serve":
        _check_kv_share(spec, plan, device_memory_bytes)
    if worst.total_bytes <= device_memory_bytes:
        return plan
    lay = plan.layout
    remedies = _remedies(plan, spec, device_memory_bytes) if isinstance(spec, TrainSpec) else []
    if worst.persistent_bytes > device_memory_bytes:
        field = "resources" if lay.dims.dp > 1 or lay.dims.world_size == 1 else "pipeline_model_parallel_size"
        advice = (
            "weights and optimizer state alone exceed the device: spread them over more devices "
            "(resources, tensor_model_parallel_size, pipeline_model_parallel_size"
            + ("" if lay.distributed_optimizer else ", use_distributed_optimizer")
            + ")"
            + (f"; it would fit with {' or '.join(remedies)}" if remedies else "")
        )
    elif worst.generation > max(worst.activations + worst.loss + worst.comm, worst.optimizer_step):
        field = "global_batch_size"
        advice = (
            f"stage grpo's generation overflows the device: {lay.generation_rows} completions per rank decoded at "
            f"once through a KV cache of seq_length {lay.seq_length} positions ({_gib(worst.generation)}); lower "
            "global_batch_size (fewer prompts per step) or seq_length (prompt + max_completion_length), or spread "
            "the groups over more data-parallel ranks"
        )
    else:  # a serve job's rows are its max_num_seqs (micro_batch_size is a training field it refuses)
        field = "micro_batch_size" if lay.max_num_seqs is None else "max_num_seqs"
        length = "seq_length" if lay.max_num_seqs is None else "max_num_batched_tokens"
        advice = (
            "activations overflow the device: "
            + (f"it would fit with {' or '.join(remedies)}" if remedies else f"lower {field} or {length}")
            + ", or raise pipeline_model_parallel_size / tensor_model_parallel_size"
        )
    dims = lay.dims
    cp, cp_rank = (f" × CP {dims.cp}", f", CP {worst.cp_rank}") if dims.cp > 1 else ("", "")
    message = (
        f"rank {worst.rank} (TP {worst.tp_rank}, PP {worst.pp_rank}, DP {worst.dp_rank}{cp_rank}) needs "
        f"{_figures(plan)}, but a device has {_gib(device_memory_bytes)} ({breakdown(worst)}; "
        f"TP {dims.tp} × PP {dims.pp} × DP {dims.dp}{cp}, {_batch_text(lay)}, "
        f"seq_length {lay.seq_length}); {advice}"
    )
    raise DoesNotFit(field, message, plan)


DEVICE_MEMORY_KEY = "device_memory_bytes"  # in a registered host's ``info``: the memory of one of its devices
HOST_MEMORY_KEY = "host_memory_bytes"  # in a registered host's ``info``: its RAM


def check_registered_memory(spec: JobBase, host_infos: Iterable[dict[str, Any] | None]) -> MemoryPlan | None:
    """Submission check: ``DoesNotFit`` when the worst rank exceeds the largest device memory any registered host of
    the job's device type reports. None (accepted unchecked) for other kinds, when no host reports its device memory
    (``info["device_memory_bytes"]``), or when the shape cannot be told before the run (the engine checks it then)."""
    if not isinstance(spec, TrainSpec | EvalSpec | ServeSpec) or (isinstance(spec, EvalSpec) and spec.remote):
        return None  # no model of its own (an eval through a deployment loads none here)
    infos = [info for info in host_infos if info]
    sizes = [int(info[DEVICE_MEMORY_KEY]) for info in infos if info.get(DEVICE_MEMORY_KEY)]
    if not sizes:
        return None
    hosts = [int(info[HOST_MEMORY_KEY]) for info in infos if info.get(HOST_MEMORY_KEY)]
    try:
        return check_fits(spec, max(sizes), host_memory_bytes=max(hosts) if hosts else None)
    except ShapeUnknown:
        return None
