"""Per-rank memory of a training or evaluation job, predicted from its spec without torch.

The accounting is Megatron's bf16 + distributed-optimizer scheme (``megatron/training/theoretical_memory_usage.py``
counts 18 bytes per parameter, 6 + 12/DP with the distributed optimizer) as this engine implements it:

- ``params``: the weights compute reads — bf16/fp16 (2 B) in a mixed-precision run, fp32 (4 B) otherwise. Under
  data parallelism, and in every mixed-precision run (one DP rank too), FSDP2 gathers them per layer from the sharded
  main weights; they stay gathered for the whole step under PP or without ``use_distributed_optimizer``
  (reshard-after-forward off), else about two layers are.
- ``main_params``: fp32 master weights of a mixed-precision run (the fp32 ``params`` themselves in an fp32 run).
- ``grads``: fp32 gradient accumulation; ``optimizer``: Adam m and v in fp32. ``main_params``, ``grads`` and
  ``optimizer`` are divided over the DP ranks when DP > 1 (FSDP2 is this engine's data parallelism and always
  shards them) — Megatron's distributed optimizer (which also keeps grads whole) differs only in the grads.
- LoRA: the frozen base once, in the compute dtype, no master copy, no grads (over DP: its shard plus what FSDP
  gathers of it, as for full training); only the adapters (fp32, created by ``engine.model.lora``) carry main
  weights, grads and Adam state. On one DP rank FSDP leaves the frozen base alone (``engine.parallel.data_parallel``),
  so it is held once. LoRA adds each adapter's rank-r A output to the saved activations (its input is the base
  matmul's, saved once in the compute dtype), a backward working set of about 6 FFN-wide rows per token that
  nothing else covers when the weights are frozen (on the last stage only beyond the loss buffers, gone by then),
  and DP gradient buffers for the adapters only.
- ``activations``: bytes autograd keeps per token per decoder layer (counted from ``engine.model.qwen3`` and
  ``engine.model.lean_ops``: norm inputs and fp32 rstd, attention's q, k, v, output and lse, SwiGLU's fc1 output,
  the matmul inputs; measured by bench/activations.py), by
  recompute mode (full: each layer's input plus one layer's working set; selective: the matmul outputs), times the
  micro-batches a rank holds at once: 1 without PP, ``PP - stage`` under 1F1B, Megatron's warm-up count of layer
  chunks under the interleaved schedule.
- ``loss``: the chunked cross-entropy (``engine.model.loss``) on the last stage: one chunk of fp32 logits (and its
  compute-dtype copy), the hidden-state gradient it writes in forward, and, when the head trains, its fp32 gradient
  twice (the accumulator and the chunk product added to it in forward; the accumulator and its scaled copy in
  backward).
- ``comm``: the pipeline's receive buffers, one per micro-batch of the step (``pipeline_buffer_bytes``), FSDP's
  gathered layer and its reduce-scatter buffer, the sequence-parallel all-gather of a layer's input.
- precision-aware optimizer and offload (``OptimizerBytes``, ``engine.train.precision_optimizer``): per trainable
  element the stored weights (4, or 2 with bf16 main grads), the grads (``main_grads_dtype``), the moments in their
  dtypes and, where the weights are not the master, the master in ``main_params_dtype``; the offloaded share of the
  master and moments is host memory (``host``), its gradients down and weights back the traffic (``host_traffic``).
- ``optimizer_step``: what the AdamW step allocates beyond its state (``engine.train.optim``): nothing with torch's
  fused kernel (CPU, CUDA: in place), else the foreach temporary (sqrt of v) of its largest parameter group, at most
  ``FOREACH_GROUP_BYTES`` or one tensor larger than that (NPU is planned so until torch_npu's fused kernel is
  confirmed on a device); activations are gone by then, so the peak is the larger of the two phases on top of the
  persistent state.

MoE (Qwen3-MoE): a rank holds the router of its stage's MoE layers and num_experts / EP of their experts (expert
parallelism, ``engine.parallel.expert_parallel``), each expert's fc1/fc2 divided by TP like the dense MLP
(Megatron's expert tensor parallel size = TP). The sharded state is the same with or without EP (experts shard over
EP then FSDP over DP / EP, the rest over DP); what EP shrinks is what FSDP gathers for compute (E/EP experts per
layer) and its gradient buffers. Activations count the top-k expert rows per token (expert widths divided by TP),
plus under EP the all-to-all's sent and received copies of them; FLOPs use the active parameters
(``ModelConfig.num_params(active=True)``, ``engine.parallel.device.flops_per_token``).

Everything is per rank; TP divides attention heads, KV groups, FFN width and vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.contract.constants import RING_SCORE_TILE_BYTES
from engine.contract.layout import ParallelDims, kv_repeats
from engine.contract.lora_targets import MEGATRON_TARGETS
from engine.contract.model_config import ModelConfig

MIB = 2**20
GIB = 2**30
PARTS = ("params", "main_params", "grads", "optimizer", "activations", "loss", "comm", "reference")


@dataclasses.dataclass(frozen=True)
class OptimizerBytes:
    """Bytes per trainable element of what the optimizer keeps, and the share of its state on the host."""

    main_grads: int = 4
    main_params: int = 4
    exp_avg: int = 4
    exp_avg_sq: int = 4
    offload: float = 0.0
    precision_aware: bool = False  # stepped by engine.train.precision_optimizer (slices), not torch's AdamW

    @property
    def weights(self) -> int:
        """The stored trainable weights: bf16 with bf16 main grads (the gradient has the weight's dtype), else the
        fp32 master itself."""
        return self.main_grads

    @property
    def own_master(self) -> bool:
        """Whether the optimizer holds a master copy beside the stored weights: where those are bf16 (the master is
        fp32 or fp16, never bf16: Megatron's choices)."""
        return self.weights != 4

    def device_bytes(self) -> int:
        """Per element on the device, for the state kept there: moments, and the master where it is a copy."""
        return self.exp_avg + self.exp_avg_sq + (self.main_params if self.own_master else 0)

    def host_bytes(self) -> int:
        """Per element on the host, for the offloaded state: moments and the master (always a copy there)."""
        return self.exp_avg + self.exp_avg_sq + self.main_params

    def traffic_bytes(self) -> int:
        """Per offloaded element per step: its gradient down, its updated weight back."""
        return self.main_grads + self.weights


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the planner adds to a job's parallel dims (``dims``: the spec's ``parallel_dims``, the one way a spec
    becomes dims) to predict its memory; built from a spec by ``layout_from_spec``."""

    dims: ParallelDims = dataclasses.field(default_factory=ParallelDims)  # one rank unless given
    nnodes: int = 1  # hosts the ranks span (their host memory is shared by a node's ranks)
    micro_batch_size: int = 1  # train and eval: the sequences of one forward on a rank
    max_num_seqs: int | None = None  # serve: the KV-cache slots decoded together (its forward's and cache's rows)
    global_batch_size: int = 1  # the spec's effective_global_batch_size
    seq_length: int = 2048
    compute_bytes: int = 4  # 2 for bf16/fp16
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    num_layer_list: tuple[int, ...] | None = None
    layers_per_virtual_stage: int | None = None
    recompute: str | None = None  # None | "full" | "selective"
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    lora_r: int | None = None
    lora_targets: tuple[str, ...] = MEGATRON_TARGETS
    loss_chunk: int = 256  # cross_entropy_chunk_size
    device_type: str = "cpu"
    train: bool = True
    eval_tokens: int = 0  # eval: prompt + new tokens per sequence (KV cache length)
    rows_per_sample: int = 1  # stage dpo: 2 (a pair's chosen and rejected answers run in one forward)
    reference_copy: bool = False  # stage dpo with a frozen second model (not LoRA, not reference-free); grpo with beta
    generation_rows: int = 0  # stage grpo: completions one rank decodes at once (its groups: global_batch_size / DP)
    # the largest micro-batch the job's data forms (``engine.contract.plan.data_shape``): rows × width padded positions,
    # pairs included; None plans every micro-batch at ``seq_length`` (the worst case)
    batch_rows: int | None = None
    batch_width: int | None = None
    # the optimizer's storage (``engine.train.precision_optimizer``), bytes per element: 4 each by default; a
    # precision-aware run names them (main_grads 2: the trainable weights and their gradients stored in bf16, the
    # master the optimizer's own copy); ``offload``: the share of the optimizer state held and stepped on the host
    optim: OptimizerBytes = OptimizerBytes()

    @property
    def rows(self) -> int:
        """Sequences of one forward on a rank: a serve job's ``max_num_seqs``, else ``micro_batch_size``."""
        return self.micro_batch_size if self.max_num_seqs is None else self.max_num_seqs

    @property
    def shards(self) -> int:
        """Ranks FSDP shards weights, gradients and optimizer state over: DP, times CP (they hold other tokens)."""
        return self.dims.dp * self.dims.cp

    @property
    def micro_batches(self) -> int:
        return max(1, self.global_batch_size // (self.micro_batch_size * self.dims.dp))

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (before sequence-parallel sharding; a CP rank's share)."""
        if self.batch_rows is not None and self.batch_width is not None:
            return -(-self.batch_rows * self.batch_width // self.dims.cp)
        return -(-self.rows * self.rows_per_sample * self.seq_length // self.dims.cp)

    @property
    def mask_bytes(self) -> int:
        """The CPU attention's boolean block mask of one micro-batch: rows × width² (none on accelerators, none
        under ring attention, which masks each block from the samples' run index)."""
        if self.device_type != "cpu" or self.dims.ring_degree > 1:
            return 0
        if self.batch_rows is not None and self.batch_width is not None:
            return self.batch_rows * self.batch_width**2
        return self.rows * self.seq_length**2


@dataclasses.dataclass
class RankMemory:
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    layers: list[int]
    num_params: int
    trainable_params: int
    params: int = 0
    main_params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    loss: int = 0
    comm: int = 0
    optimizer_step: int = 0
    micro_batches_in_flight: int = 0
    cp_rank: int = 0  # its context-parallel rank (it holds 1/CP of each sequence)
    reference: int = 0  # stage dpo's (grpo's with beta) frozen reference model (``reference_bytes``)
    generation: int = 0  # stage grpo's rollout working set (``generation_bytes``): not alive with the activations
    host: int = 0  # host memory the rank's offloaded optimizer state (and its step's temporaries) takes
    host_traffic: int = 0  # bytes copied host <-> device per step for the offloaded state

    @property
    def persistent_bytes(self) -> int:
        return self.params + self.main_params + self.grads + self.optimizer + self.reference

    @property
    def total_bytes(self) -> int:
        """Peak: the persistent state plus the largest of the forward/backward, optimizer-step and (stage grpo)
        generation working sets."""
        working = max(self.activations + self.loss + self.comm, self.optimizer_step, self.generation)
        return self.persistent_bytes + working

    def as_json(self, cp: int = 1) -> dict[str, Any]:
        """The rank's figures; ``cp_rank`` only under context parallelism (``cp``: its degree)."""
        out = {
            "rank": self.rank,
            "total_bytes": self.total_bytes,
            "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            **({"cp_rank": self.cp_rank} if cp > 1 else {}),
            "layers": [self.layers[0], self.layers[-1]] if self.layers else [],
            "num_params": self.num_params,
            "trainable_params": self.trainable_params,
        }
        out.update({f"{p}_bytes": getattr(self, p) for p in PARTS})
        out["optimizer_step_bytes"] = self.optimizer_step
        out["generation_bytes"] = self.generation
        out["host_bytes"] = self.host
        out["host_traffic_bytes_per_step"] = self.host_traffic
        out["persistent_bytes"] = self.persistent_bytes
        out["micro_batches_in_flight"] = self.micro_batches_in_flight
        return out


# ------------------------------------------------------------------ parameters


def stage_layers(cfg: ModelConfig, lay: Layout) -> list[list[int]]:
    """Global layer indices per pipeline stage index (same split as ``engine.parallel.pipeline_parallel``)."""
    if lay.num_layer_list is not None:
        counts = list(lay.num_layer_list)
    else:
        per = lay.layers_per_virtual_stage or cfg.num_layers // lay.dims.pp
        counts = [per] * (cfg.num_layers // per)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [list(range(s, s + c)) for s, c in zip(starts, counts, strict=True)]


def layer_params(cfg: ModelConfig, tp: int, layer: int | None = None, ep: int = 1) -> int:
    """Parameters of decoder layer ``layer`` on one TP rank (None: the largest layer). An MoE layer holds its
    router (replicated) and num_experts / ``ep`` experts, each expert's TP slice (fc1 and fc2 cut per expert like the
    dense MLP)."""
    h, d = cfg.hidden_size, cfg.kv_channels
    attn = h * cfg.qkv_rows // tp + cfg.num_attention_heads * d * h // tp + 2 * d
    moe = cfg.is_moe_layer(layer) if layer is not None else bool(cfg.moe_layers)
    if moe:
        e = cfg.num_experts or 0
        return attn + e * h + expert_params(cfg) // ep // tp + 2 * h
    return attn + cfg.family.mlp_matrices * h * cfg.ffn_hidden_size // tp + 2 * h


def expert_params(cfg: ModelConfig, layer: int | None = None) -> int:
    """The stacked expert weights of one MoE layer (all experts; 0 for a dense layer)."""
    moe = cfg.is_moe_layer(layer) if layer is not None else bool(cfg.moe_layers)
    matrices = cfg.family.mlp_matrices
    return (cfg.num_experts or 0) * matrices * cfg.hidden_size * cfg.expert_ffn_hidden_size if moe else 0


def lora_layer_params(cfg: ModelConfig, tp: int, r: int, targets: tuple[str, ...], layer: int | None = None) -> int:
    """Adapter parameters of one layer on one TP rank: column-parallel targets shard B, row-parallel shard A. In an
    MoE layer ``linear_fc1``/``linear_fc2`` adapt every expert (one adapter pair each)."""
    h, f, ad = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads * cfg.kv_channels
    moe = cfg.is_moe_layer(layer) if layer is not None else bool(cfg.moe_layers)
    copies = (cfg.num_experts or 0) if moe else 1
    if moe:
        f = cfg.expert_ffn_hidden_size
    shapes = {
        "linear_qkv": (h, cfg.qkv_rows, "col", 1),
        "linear_fc1": (h, 2 * f, "col", copies),
        "linear_proj": (ad, h, "row", 1),
        "linear_fc2": (f, h, "row", copies),
    }
    total = 0
    for name in targets:
        fan_in, fan_out, kind, n = shapes[name]
        total += n * (r * fan_in + r * fan_out // tp if kind == "col" else r * fan_in // tp + r * fan_out)
    return total


def _rank_params(cfg: ModelConfig, lay: Layout, layers: list[int], first: bool, last: bool) -> tuple[int, int]:
    """(all parameters, trainable parameters) of one rank."""
    base = sum(layer_params(cfg, lay.dims.tp, i) for i in layers)
    vocab_rows = cfg.vocab_size * cfg.hidden_size // lay.dims.tp
    if first:
        base += vocab_rows
    if last:
        base += cfg.hidden_size  # final norm
        if not cfg.tie_word_embeddings or not first:
            base += vocab_rows  # untied head, or a tied model's copy on the last stage (Megatron's rule)
    if lay.lora_r is None:
        return base, base
    adapters = sum(lora_layer_params(cfg, lay.dims.tp, lay.lora_r, lay.lora_targets, i) for i in layers)
    return base + adapters, adapters


# ------------------------------------------------------------------ activations


def layer_activation_bytes(cfg: ModelConfig, lay: Layout, tokens: int) -> int:
    """Bytes autograd saves for one decoder layer over ``tokens`` tokens, without recompute, as
    ``engine.model.qwen3`` with ``engine.model.lean_ops`` saves them (bench/activations.py counts them on the meta
    device and checks this figure within 5 %)."""
    e, tp = lay.compute_bytes, lay.dims.tp
    h, f = cfg.hidden_size, cfg.ffn_hidden_size // tp
    a, g, d = cfg.num_attention_heads // tp, cfg.num_query_groups // tp, cfg.kv_channels
    sp = tp if lay.sequence_parallel else 1
    norm = (e * h + 4) // sp + e * h  # input and fp32 rstd (SP-sharded); the normed rows, the next matmul's input
    fam = cfg.family
    q = e * a * d + 4 * a if fam.qk_norm else 0  # the q norm's input and rstd per head
    k = e * g * d + 4 * g if fam.qk_norm else 0
    if (
        lay.device_type == "cpu" and lay.dims.ring_degree == 1
    ):  # sdpa with a block mask: k and v expanded to every query head
        attn = 5 * e * a * d + 4 * a  # q, k, v (expanded), output, lse, proj input
    else:  # flash/varlen kernels: q, k, v, output (also linear_proj's input, a view of it), fp32 lse
        ulysses = lay.dims.ulysses_degree  # KV heads that do not split over it are repeated first (layout.kv_repeats)
        attn = 2 * e * a * d + 2 * e * g * kv_repeats(g, ulysses) * d + 4 * a
    mlp = fam.fc1_widths * e * f if _has_dense(cfg) else 0  # fc1's output (gate|up) only: SwiGLU is rebuilt
    if cfg.moe_layers:  # the largest layer's: an MoE one (engine.model.moe) where it is bigger
        mlp = max(mlp, moe_activation_bytes(cfg, lay))
    return tokens * (2 * norm + q + k + attn + mlp)


def lora_activation_bytes(cfg: ModelConfig, lay: Layout, tokens: int) -> int:
    """What LoRA adds to one layer's saved activations: each adapter's rank-r A output (lora_B's input, in the
    compute dtype FSDP casts the adapters to). Its input is the base matmul's own (``engine.model.lora._AdapterIn``
    saves it in the compute dtype), already counted; MoE targets adapt every routed choice."""
    if lay.lora_r is None:
        return 0
    per_token = sum(
        cfg.moe_router_topk if cfg.moe_layers and name in ("linear_fc1", "linear_fc2") else 1
        for name in lay.lora_targets
    )
    return tokens * per_token * lay.lora_r * lay.compute_bytes


LORA_BACKWARD_FFN_COPIES = 6  # measured: tests/integration/test_plan_measured.py pp2-lora, stage 0


def lora_backward_working_set(cfg: ModelConfig, lay: Layout, tokens: int) -> int:
    """LoRA's backward peak beyond the saved activations: one MLP's gradients in flight (fc1's output gradient
    [gate; up], the SwiGLU backward's temporaries, the rebuilt product), about 6 FFN-wide rows per token. In full
    training the not-yet-written weight gradients, counted whole, cover it; with frozen weights nothing does."""
    if lay.lora_r is None:
        return 0
    f = (cfg.expert_ffn_hidden_size * cfg.moe_router_topk if cfg.moe_layers else cfg.ffn_hidden_size) // lay.dims.tp
    return LORA_BACKWARD_FFN_COPIES * f * lay.compute_bytes * tokens


def _has_dense(cfg: ModelConfig) -> bool:
    return len(cfg.moe_layers) < cfg.num_layers


def moe_activation_bytes(cfg: ModelConfig, lay: Layout) -> int:
    """Per token, what an MoE MLP saves: the router logits (the fp32 softmax is recomputed from them where they are
    narrower, ``engine.model.lean_ops.softmax_fp32``), the top-k ids, weights and their sum, the sort order; per choice fc1's output and the routing weight. fc1 re-gathers its input rows from the tokens (kept
    as the router's input) in backward (``engine.model.gathered_matmul``), except where the rows themselves are
    kept: expert parallelism exchanges gathered rows, and LoRA-adapted experts save them for the adapters."""
    e, topk = lay.compute_bytes, cfg.moe_router_topk
    fe, ne = cfg.expert_ffn_hidden_size // lay.dims.tp, cfg.num_experts or 0
    router = min(e, 4) * ne + 8 * topk + 4 * topk + 4 + 8 * topk
    adapted = lay.lora_r is not None and any(t in ("linear_fc1", "linear_fc2") for t in lay.lora_targets)
    rows = cfg.hidden_size if lay.dims.ep > 1 or adapted else 0
    return router + topk * e * (rows + cfg.family.fc1_widths * fe + 1)


def _selective_bytes(cfg: ModelConfig, lay: Layout, tokens: int) -> int:
    """Selective recompute keeps the layer input and every matmul output (``engine.parallel.activation_checkpoint``)."""
    e, tp = lay.compute_bytes, lay.dims.tp
    h, f = cfg.hidden_size, cfg.ffn_hidden_size // tp
    widths = cfg.family.fc1_widths
    mlp = widths * f + h if _has_dense(cfg) else 0
    if cfg.moe_layers:  # router logits, and per choice the expert fc1 and fc2 outputs
        per_choice = widths * cfg.expert_ffn_hidden_size // tp + h
        mlp = max(mlp, (cfg.num_experts or 0) + cfg.moe_router_topk * per_choice)
    return tokens * e * (h + cfg.qkv_rows // tp + h + mlp)


def stage_activation_bytes(cfg: ModelConfig, lay: Layout, layers: int, tokens: int) -> int:
    """One micro-batch's activations in a stage of ``layers`` layers (plus the per-forward RoPE tables and mask)."""
    adapters = lora_activation_bytes(cfg, lay, tokens)  # kept wherever the layer's own activations are
    full = layer_activation_bytes(cfg, lay, tokens) + adapters
    if lay.recompute == "full":
        kept = layers if lay.recompute_method != "block" else min(layers, lay.recompute_num_layers or layers)
        boundary = tokens * lay.compute_bytes * cfg.hidden_size // (lay.dims.tp if lay.sequence_parallel else 1)
        per_mb = kept * boundary + (layers - kept) * full
    elif lay.recompute == "selective":
        per_mb = layers * (_selective_bytes(cfg, lay, tokens) + adapters)
    else:
        per_mb = layers * full
    rope = 2 * tokens * cfg.kv_channels * lay.compute_bytes
    return per_mb + rope + lay.mask_bytes


def ring_working_set(cfg: ModelConfig, lay: Layout, tokens: int) -> int:
    """Ring attention's backward beyond the saved activations (``engine.parallel.ring_attention``): K/V blocks in
    flight (sent and received), their fp32 gradients travelling with them (two), the block's K/V expanded to every
    query head in fp32, dq, q and dO in fp32, and about four score tiles. Under hybrid CP the ring holds ``Ulysses ×``
    the tokens for ``1 / Ulysses`` of the heads: the same bytes (KV heads repeated to split count repeated)."""
    if lay.dims.ring_degree == 1:
        return 0
    e, a, g, d = (
        lay.compute_bytes,
        cfg.num_attention_heads // lay.dims.tp,
        cfg.num_query_groups // lay.dims.tp,
        cfg.kv_channels,
    )
    g *= kv_repeats(g, lay.dims.ulysses_degree)
    per_token = d * (2 * 2 * e * g + 2 * 2 * 4 * g + 2 * 4 * a + 3 * 4 * a)
    return tokens * per_token + 4 * RING_SCORE_TILE_BYTES


def recompute_working_set(cfg: ModelConfig, lay: Layout, tokens: int) -> int:
    """Extra bytes while one recomputed layer is re-run in backward."""
    if lay.recompute == "full":
        return layer_activation_bytes(cfg, lay, tokens)
    if lay.recompute == "selective":
        return layer_activation_bytes(cfg, lay, tokens) - _selective_bytes(cfg, lay, tokens)
    return 0


def in_flight(lay: Layout, pp_rank: int, chunks: int) -> int:
    """Micro-batch activations (in units of one chunk of layers) a pipeline rank holds at its peak."""
    m = lay.micro_batches
    if lay.dims.pp == 1:
        return 1
    if chunks == 1:  # 1F1B: stage p runs PP - p forwards before its first backward
        return min(m, lay.dims.pp - pp_rank)
    warmup = (lay.dims.pp - pp_rank - 1) * 2 + (chunks - 1) * lay.dims.pp  # Megatron's interleaved warm-up
    return min(m * chunks, warmup + 1)


def boundary_bytes(cfg: ModelConfig, lay: Layout) -> int:
    """The hidden states of one micro-batch that a pipeline stage sends the next (a sequence shard under SP)."""
    return lay.tokens * cfg.hidden_size * lay.compute_bytes // (lay.dims.tp if lay.sequence_parallel else 1)


def pipeline_buffer_bytes(cfg: ModelConfig, lay: Layout, stage_ids: list[int], n_stages: int, held: int) -> int:
    """What ``torch.distributed.pipelining`` keeps on a training rank beside the activations, over the whole step.
    Each ``PipelineStage`` allocates, once per micro-batch index, a buffer for the hidden states the previous stage
    sends and one for the gradient the next stage sends back, and keeps them all: they grow with the step's
    micro-batches (global_batch_size / (micro_batch_size × DP)), not with those in flight. A received input in flight
    is its first layer's saved input (counted with the activations) and its output, kept until its backward, is
    not: they cancel past the first stage; the first stage adds its ``held`` outputs (under the interleaved
    schedule every chunk in flight: a bound). Plus every micro-batch's ids, labels and positions, int64, stacked on
    the device for the step (``engine.parallel.pipeline_parallel.stack_micro_batches``)."""
    m = lay.micro_batches
    buffers = sum(m * ((s > 0) + (s < n_stages - 1)) for s in stage_ids) + (held if 0 in stage_ids else 0)
    return buffers * boundary_bytes(cfg, lay) + m * 3 * 8 * lay.tokens


def loss_bytes(cfg: ModelConfig, lay: Layout, head_trains: bool) -> int:
    e, v = lay.compute_bytes, cfg.vocab_size // lay.dims.tp
    rows = min(lay.loss_chunk, lay.tokens)
    # a chunk's fp32 logits and, at the peak, two more buffers of that size (logsumexp's shifted copy, its exp):
    # measured 3.0 chunks of extra RSS around ``chunked_cross_entropy`` on CPU
    logits = rows * v * (3 * 4 + (e if e != 4 else 0))
    hidden_grad = lay.tokens * cfg.hidden_size * e
    # the fp32 head gradient accumulated in forward, plus its product being added, plus backward's scaled copy
    head_grad = 2 * v * cfg.hidden_size * 4 if head_trains else 0
    return logits + hidden_grad + head_grad


# ------------------------------------------------------------------ per rank


FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # engine.parallel.device.has_fused_adamw is true there
FOREACH_GROUP_BYTES = 256 * 2**20  # engine.train.optim's bound on a foreach group


PRECISION_SLICE_NUMEL = 16 * 2**20  # engine.train.precision_optimizer.SLICE_NUMEL


def precision_step_slices(opt: OptimizerBytes, host: bool) -> int:
    """fp32 slices alive at once in the precision-aware step: ``sqrt(v)`` and its quotient, plus an fp32 copy of each
    operand not already an fp32 tensor where the step runs (the gradient on the host always, on the device where
    bf16; the master where fp16; each 16-bit moment); an fp32 operand is used in place (``.float()`` returns it)."""
    grad_copy = host or opt.main_grads != 4
    return 2 + grad_copy + (opt.main_params != 4) + (opt.exp_avg != 4) + (opt.exp_avg_sq != 4)


def precision_step_bytes(cfg: ModelConfig, lay: Layout, trainable: int, host: bool = False) -> int:
    """The precision-aware step's fp32 temporaries on the device (``host``: on the host, for the offloaded share):
    ``precision_step_slices`` slices of the largest tensor, at most ``SLICE_NUMEL`` elements each."""
    largest = cfg.vocab_size * cfg.hidden_size // lay.dims.tp // lay.shards
    slices = precision_step_slices(lay.optim, host)
    return slices * 4 * min(PRECISION_SLICE_NUMEL, largest, trainable // lay.shards)


def optimizer_step_bytes(cfg: ModelConfig, lay: Layout, trainable: int, precision_aware: bool = False) -> int:
    """The AdamW step's temporary on one rank: none when fused, else one foreach group's fp32 ``sqrt(v)``: the
    bound, the whole trainable shard when smaller, or the largest tensor (the embedding or head) when larger. The
    precision-aware step's slices (``precision_step_bytes``) where the device steps any of the state."""
    if precision_aware:
        return precision_step_bytes(cfg, lay, trainable) if lay.optim.offload < 1 else 0
    if lay.device_type in FUSED_ADAMW_DEVICES:
        return 0
    largest = cfg.vocab_size * cfg.hidden_size // lay.dims.tp * 4 // lay.shards
    return min(trainable * 4 // lay.shards, max(FOREACH_GROUP_BYTES, largest))


def _fill_state(
    m: RankMemory, lay: Layout, per_layer_params: int, elsewhere: int = 0, per_layer_adapters: int = 0
) -> None:
    """params / main_params / grads / optimizer of one rank, and the transient gathered layers of FSDP.
    ``elsewhere``: base weights of the rank's layers that live on other EP ranks (never gathered here)."""
    e, dp = lay.compute_bytes, lay.shards
    trainable, frozen = m.trainable_params, m.num_params - m.trainable_params
    held_trainable = trainable - (elsewhere if lay.lora_r is None else 0)
    held_frozen = frozen - (elsewhere if lay.lora_r is not None else 0)
    mixed = e != 4
    # engine.parallel.parallelize applies FSDP2 over DP > 1 and to every mixed-precision run, one DP rank included;
    # at one rank FSDP2 still copies each group into its unsharded buffer (the cast, or a copy where the stored
    # dtype is the compute one) and frees it on reshard, and still fills its reduce-scatter input and output: the
    # same bytes as over DP > 1 (torch/distributed/fsdp/_fully_shard: wait_for_unshard, foreach_reduce at world 1).
    fsdp = dp > 1 or mixed
    resharding = fsdp and lay.distributed_optimizer and lay.dims.pp == 1  # FSDP reshards after forward
    gathered = 2 * per_layer_params * e if resharding else 0
    opt = lay.optim
    on_device = trainable - int(trainable * opt.offload)  # the optimizer state's share kept on the device
    if lay.lora_r is None:
        compute = held_trainable * e
        # fp32 one process: the params are the main weights; under FSDP the sharded fp32 weights are the main ones
        m.params = 0 if (not mixed and dp == 1) else (gathered if resharding else compute)
    else:
        # the frozen base: its FSDP shard (in the compute dtype) plus, over DP, what is gathered of it for compute
        shard = frozen * e // dp
        # one DP rank: FSDP ignores the frozen base (engine.parallel.data_parallel), nothing of it is gathered
        m.params = shard + ((gathered if resharding else held_frozen * e) if dp > 1 else 0)
    # the stored trainable weights (the fp32 master, or bf16 with bf16 main grads) and the optimizer's own master
    m.main_params = (trainable * opt.weights + (on_device * opt.main_params if opt.own_master else 0)) // dp
    m.grads = trainable * opt.main_grads // dp
    m.optimizer = on_device * (opt.exp_avg + opt.exp_avg_sq) // dp
    offloaded = trainable - on_device
    m.host = offloaded * opt.host_bytes() // dp
    m.host_traffic = offloaded * opt.traffic_bytes() // dp
    if fsdp:  # a layer's unsharded fp32 grads and its reduce-scatter output: the adapters' only under LoRA
        reduced = per_layer_params if lay.lora_r is None else per_layer_adapters
        m.comm += 2 * reduced * 4


def reference_bytes(cfg: ModelConfig, lay: Layout, m: RankMemory) -> int:
    """Stage dpo's frozen reference (``engine.train.dpo``): its weights in the compute dtype (an FSDP shard over DP,
    plus the two layers gathered around the one computing), and its no-grad forward's transient while the policy's
    activations are held: one layer's working set and one loss chunk. The doubled sequences themselves are counted by
    ``Layout.rows_per_sample``. LoRA runs (adapters off) and reference-free losses have no copy: 0."""
    if not lay.reference_copy:
        return 0
    e = lay.compute_bytes
    gathered = 2 * layer_params(cfg, lay.dims.tp, ep=lay.dims.ep) * e if lay.dims.dp > 1 else 0
    forward = layer_activation_bytes(cfg, lay, lay.tokens) + min(lay.loss_chunk, lay.tokens) * cfg.vocab_size * 4
    return m.num_params * e // lay.dims.dp + gathered + forward


def kv_cache_bytes(cfg: ModelConfig, lay: Layout, layers: int) -> int:
    """Keys and values of ``layers`` layers for ``Layout.rows`` rows of ``eval_tokens`` positions on one TP rank
    (eval's ``micro_batch_size``; a serve job's ``max_num_seqs`` slots of ``max_model_len``)."""
    rows = 2 * layers * lay.rows * lay.eval_tokens * (cfg.num_query_groups // lay.dims.tp)
    return rows * cfg.kv_channels * lay.compute_bytes


def generation_bytes(cfg: ModelConfig, lay: Layout, layers: int, last: bool = True) -> int:
    """Stage grpo's rollout (``engine.train.grpo_rollout.decode``): the rank's ``generation_rows`` completions decoded
    in one batch through a KV cache of prompt + max_completion_length positions (at most ``seq_length``, which the
    engine holds them to), in the dtype of the model's first parameter (decode's choice: the stored trainable
    weights', fp32 under bf16 unless precision-aware; a LoRA run's frozen base in the compute dtype) with the TP
    rank's KV heads, for the rank's ``layers`` (a pipeline stage caches its own); plus the prefill's no-grad
    transient (one layer's working set over every row's prompt, its CPU mask) and, on the ``last`` stage (the one
    that samples), the last position's logits. 0 otherwise."""
    if not lay.generation_rows:
        return 0
    e = lay.compute_bytes if lay.lora_r is not None else max(lay.compute_bytes, lay.optim.weights)
    whole = dataclasses.replace(lay.dims, cp=1)  # decode runs whole sequences: no context parallelism
    gen = dataclasses.replace(
        lay, dims=whole, micro_batch_size=lay.generation_rows, eval_tokens=lay.seq_length, compute_bytes=e
    )
    rows, width = lay.generation_rows, lay.seq_length
    cache = kv_cache_bytes(cfg, gen, layers) + gqa_expansion_bytes(cfg, gen)
    prefill = layer_activation_bytes(cfg, gen, rows * width) + (rows * width**2 if lay.device_type == "cpu" else 0)
    logits = rows * cfg.vocab_size // lay.dims.tp * 4 if last else 0
    return cache + prefill + logits


def gqa_expansion_bytes(cfg: ModelConfig, lay: Layout) -> int:
    """Attention over the cache with a mask (``engine.model.attention.core_attention``): off CPU SDPA's masked kernels
    take no GQA, so one layer's keys and values are repeated to every query head for the step's rows over the whole
    cache width, transient (measured by ``python -m engine trace`` on a serve job: 4 GiB for Qwen3-4B, 32 slots ×
    8,192 positions). On CPU serving hands SDPA the GQA directly: not counted there."""
    heads, groups = cfg.num_attention_heads // lay.dims.tp, cfg.num_query_groups // lay.dims.tp
    if lay.device_type == "cpu" or groups >= heads:
        return 0
    return 2 * lay.rows * heads * lay.eval_tokens * cfg.kv_channels * lay.compute_bytes


def plan_ranks(cfg: ModelConfig, lay: Layout) -> list[RankMemory]:
    """Predicted memory of every rank, in global rank order (its coordinates ``ParallelDims.coords``'s, the mesh's)."""
    stages = stage_layers(cfg, lay)
    chunks = len(stages) // lay.dims.pp
    out: list[RankMemory] = []
    for rank in range(lay.dims.world_size):
        at = lay.dims.coords(rank)
        pp_rank = at.pp
        mine = [stages[v * lay.dims.pp + pp_rank] for v in range(chunks)]
        layers = [i for chunk in mine for i in chunk]
        first, last = pp_rank == 0, pp_rank == lay.dims.pp - 1
        total, trainable = _rank_params(cfg, lay, layers, first, last)
        m = RankMemory(rank, at.tp, pp_rank, at.dp, layers, total, trainable if lay.train else 0, cp_rank=at.cp)
        if lay.train:
            # this rank's TP slice of its layers' experts held by the other EP ranks (layer_params cuts experts by TP)
            elsewhere = sum(expert_params(cfg, i) // lay.dims.tp for i in layers) * (lay.dims.ep - 1) // lay.dims.ep
            adapters = 0 if lay.lora_r is None else lora_layer_params(cfg, lay.dims.tp, lay.lora_r, lay.lora_targets)
            _fill_state(m, lay, layer_params(cfg, lay.dims.tp, ep=lay.dims.ep), elsewhere, adapters)
            m.optimizer_step = optimizer_step_bytes(cfg, lay, trainable, lay.optim.precision_aware)
            if lay.optim.offload > 0:  # the host steps its share in the same slices
                m.host += precision_step_bytes(cfg, lay, trainable, host=True)
            m.reference = reference_bytes(cfg, lay, m)
            m.generation = generation_bytes(cfg, lay, len(layers), last)
        else:  # evaluation loads the weights in the dtype it runs in; nothing trains
            m.params = total * lay.compute_bytes
        tokens = lay.tokens
        if lay.train:
            held = in_flight(lay, pp_rank, chunks)
            chunk_layers = max(len(c) for c in mine)
            m.micro_batches_in_flight = held
            m.activations = held * stage_activation_bytes(cfg, lay, chunk_layers, tokens)
            m.activations += recompute_working_set(cfg, lay, tokens) + ring_working_set(cfg, lay, tokens)
            if last:
                head_trains = lay.lora_r is None
                m.loss = loss_bytes(cfg, lay, head_trains)
            # the loss's buffers are gone before any layer's backward runs: the larger of the two is the peak
            m.activations += max(0, lora_backward_working_set(cfg, lay, tokens) - m.loss)
        else:
            m.activations = kv_cache_bytes(cfg, lay, len(layers)) + layer_activation_bytes(cfg, lay, tokens)
            m.activations += gqa_expansion_bytes(cfg, lay)
            if last:
                m.loss = lay.rows * cfg.vocab_size // lay.dims.tp * 4
        if lay.dims.pp > 1 and lay.train:
            stage_ids = [v * lay.dims.pp + pp_rank for v in range(chunks)]
            m.comm += pipeline_buffer_bytes(cfg, lay, stage_ids, len(stages), m.micro_batches_in_flight)
        elif lay.dims.pp > 1:  # forward only: one micro-batch's hidden states sent and received
            m.comm += 2 * boundary_bytes(cfg, lay)
        if lay.dims.tp > 1 and lay.sequence_parallel:
            m.comm += tokens * cfg.hidden_size * lay.compute_bytes
        if (
            lay.train and lay.dims.ep > 1 and cfg.moe_layers
        ):  # the all-to-all: rows (+ weight) sent, received, regrouped
            m.comm += 3 * tokens * cfg.moe_router_topk * (cfg.hidden_size + 1) * lay.compute_bytes
        out.append(m)
    return out
