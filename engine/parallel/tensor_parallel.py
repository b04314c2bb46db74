"""Tensor and sequence parallelism for ``Qwen3Model``, applied from outside the model (torchtitan's ``apply_tp``).

Layout (Megatron's per-rank layout, so mcore TP shards are this rank's local tensors without any reshuffling):
- ``linear_qkv``: column-parallel, a plain dim-0 shard. The fused weight is interleaved per KV group
  ([q heads of group g; k_g; v_g] for g = 0..ng-1), so an even dim-0 shard gives each rank ng/TP *whole* groups,
  which is what the model's ``view(B, T, -1, (heads_per_group + 2) * d)`` expects. TP must divide ng.
- ``linear_fc1``: column-parallel with rank k holding ``[gate_k; up_k]``. The global (native) tensor stays
  ``[gate; up]`` and the placement is ``_StridedShard(0, split_factor=2)``: the tensor is cut into the 2 halves,
  each half is sharded over TP, and rank k holds the concatenation of its pieces. So the DTensor's full tensor is
  the native key's layout while the local tensor is Megatron's shard. DCP cannot store a non-contiguous shard, so
  ``dcp_view`` presents such tensors to DCP as ``Shard(0)`` of the same global tensor (see there).
- ``linear_proj`` / ``linear_fc2``: row-parallel (dim 1).
- ``embedding.word_embeddings`` / ``output_layer``: vocab-parallel (dim 0); the loss is ``vocab_parallel_cross_entropy``.
- MoE layers (``ExpertTensorParallel``; Megatron's default, expert tensor parallel size = TP): the router is
  replicated and sees every token (with sequence parallelism the tokens are all-gathered before routing, as
  Megatron does), so every rank routes identically; each expert's fc1 / fc2 is cut like the dense ones, per
  expert: the stacked ``(E, 2F, H)`` fc1 is ``_StridedShard(1, split_factor=2)`` (rank k: every expert's
  ``[gate_k; up_k]``), the ``(E, H, F)`` fc2 ``Shard(2)``. The partial outputs are summed over TP (all-reduce, or
  reduce-scatter onto the sequence dim). LoRA on experts: fc1 A and fc2 B replicated, fc1 B and fc2 A cut like
  their base (``engine.checkpoint.layout.split_rule``'s rules).
- Norms: ``SequenceParallel`` when sequence parallelism is on (the residual stream is a DTensor sharded on the
  sequence dim between the TP regions), otherwise replicated DTensor parameters (``_Replicated``).
- ``q_layernorm`` / ``k_layernorm`` act per head on head-sharded activations; every rank only sees its own heads,
  so each rank's weight gradient is a partial sum. They use ``SequenceParallel(sequence_dim=2)``: a replicated
  DTensor weight applied to an input sharded on the heads dim, so DTensor all-reduces the weight gradient.

PyTorch primitives used (they run on gloo, nccl and hccl): ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` (subclassed only to place LoRA adapters and the strided fc1), ``SequenceParallel``,
``DTensor.from_local`` / ``redistribute`` (all-gather, reduce-scatter, all-reduce chosen by DTensor). Written out
where the primitive is missing or wasteful:
- the vocab-parallel embedding (``VocabParallelEmbedding``): masked local lookup + a ``Partial`` DTensor reduced by
  DTensor, because ``RowwiseParallel``'s embedding backward builds a full (V × H) gradient on every rank;
- the chunked vocab-parallel cross-entropy: Megatron's algorithm with explicit ``all_reduce`` MAX/SUM over the TP
  group (PyTorch's ``loss_parallel`` needs its context manager around backward and full-sequence logits).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, TypeGuard, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement

from engine.contract import layout
from engine.contract.constants import IGNORE_INDEX
from engine.model.decoder_lm import decoder_lm
from engine.model.moe import MoELayer
from engine.torch_compat import StridedShard, colwise_prepare_output_fn, compute_local_shape_and_global_offset


def _place(param: torch.Tensor, mesh: DeviceMesh, placement: Placement | str) -> DTensor:
    if placement == "gate_up":
        return _distribute_strided(param.detach(), mesh, dim=0)
    if isinstance(placement, StridedShard):  # [gate; up] on another dim (stacked experts: dim 1)
        return _distribute_strided(param.detach(), mesh, dim=placement.dim)
    assert not isinstance(placement, str), placement
    return distribute_tensor(param.detach(), mesh, [placement], src_data_rank=0)


def _partition_by_submodule(placements: Mapping[str, Placement | str]) -> Callable[[str, nn.Module, DeviceMesh], None]:
    """partition_fn for ``distribute_module``: the base Linear (name "") and LoRA's ``lora_A`` / ``lora_B``
    sub-Linears each get their own placement (MindSpeed ``lora_moe.py`` sharding of adapters)."""

    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name not in placements:
            return
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = placements[name] if pname == "weight" or placements[name] == "gate_up" else placements["bias"]
            dparam = nn.Parameter(_place(param, mesh, placement), requires_grad=param.requires_grad)
            module.register_parameter(pname, dparam)

    return partition


class ColumnParallel(ColwiseParallel):
    """``ColwiseParallel`` for ``nn.Linear`` and LoRA-wrapped Linears (``engine.model.lora.LoRALinear``).

    Base weight ``Shard(0)``; LoRA: A replicated (r, H), B sharded like the base rows (out/TP, r). With
    ``gate_up=True`` (fused ``[gate; up]`` fc1) base and B use ``_StridedShard(0, split_factor=2)`` so that rank k
    holds ``[gate_k; up_k]`` (Megatron's per-rank layout) while the global tensor keeps the native ``[gate; up]``."""

    def __init__(
        self,
        *,
        gate_up: bool = False,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        rows: Placement | str = "gate_up" if gate_up else Shard(0)
        self.placements = {"": rows, "lora_A": Replicate(), "lora_B": rows, "bias": Shard(0)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            _partition_by_submodule(self.placements),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._local_output_fn, self.output_layouts, self.use_local_output),
        )

    @staticmethod
    def _local_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # noqa: ANN001, ANN205
        # A strided output (fc1: locally [gate_k | up_k]) is exactly what the MLP's chunk(2) needs: no redistribute.
        if use_local_output and any(isinstance(p, StridedShard) for p in outputs.placements):
            return outputs.to_local()
        return colwise_prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


class RowParallel(RowwiseParallel):
    """``RowwiseParallel`` for ``nn.Linear`` and LoRA-wrapped Linears: base weight ``Shard(1)``; LoRA A sharded on
    its input dim (r, in/TP), B replicated (out, r). The adapter's partial sums join the base output's partial sums,
    so the one reduce(-scatter) of the row-parallel output also reduces the adapter path."""

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self.placements = {"": Shard(1), "lora_A": Shard(1), "lora_B": Replicate(), "bias": Replicate()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            return super()._apply(module, device_mesh)  # nn.Embedding: PyTorch's vocab-parallel embedding
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            _partition_by_submodule(self.placements),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class VocabParallelEmbedding(ParallelStyle):
    """Megatron's ``VocabParallelEmbedding`` for ``nn.Embedding``: rank k holds vocabulary rows
    [k·V/TP, (k+1)·V/TP) (``Shard(0)``), looks up the ids it owns (others give zeros), and the partial sums are
    reduced (all-reduce, or reduce-scatter onto the sequence dim with sequence parallelism).

    Written out instead of ``RowwiseParallel`` on the embedding: that works, but its backward produces a full
    replicated (V × H) gradient on every rank (measured: 151,936 × H fp32 per rank for Qwen3); here each rank's
    gradient is its own rows only. Primitives: ``DTensor.from_local(..., Partial())`` + ``redistribute``."""

    def __init__(self, output_layout: Placement, use_local_output: bool) -> None:
        super().__init__()
        self.output_layout, self.use_local_output = output_layout, use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding: expects nn.Embedding, got {type(module).__name__}")
        weight = module.weight
        module.weight = nn.Parameter(_place(weight, device_mesh, Shard(0)), requires_grad=weight.requires_grad)
        style = self

        def forward(ids: torch.Tensor) -> torch.Tensor:
            local = cast(DTensor, module.weight).to_local()  # (V/TP, H); its gradient stays this rank's rows
            offset = ids - device_mesh.get_local_rank() * local.shape[0]
            outside = (offset < 0) | (offset >= local.shape[0])
            out = F.embedding(offset.masked_fill(outside, 0), local).masked_fill(outside.unsqueeze(-1), 0.0)
            out = DTensor.from_local(out, device_mesh, [Partial()], run_check=False)
            out = out.redistribute(placements=[style.output_layout])
            return out.to_local() if style.use_local_output else out

        module.forward = forward  # type: ignore[method-assign, assignment]  # this instance's forward, on purpose
        return module


def _distribute_strided(full: torch.Tensor, mesh: DeviceMesh, dim: int) -> DTensor:
    """A DTensor whose rank-k local tensor is cat(half0_k, half1_k) along ``dim``; the global tensor is ``full``."""
    n, k = mesh.size(), mesh.get_local_rank()
    halves = full.chunk(2, dim=dim)
    local = torch.cat([h.chunk(n, dim=dim)[k] for h in halves], dim=dim).contiguous()
    placements = [StridedShard(dim, split_factor=2)]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


class _Replicated(ParallelStyle):
    """Parameters become replicated DTensors; inputs/outputs stay local (TP without sequence parallelism).

    Keeps every parameter of a TP model a DTensor on the TP mesh, so grad-norm and DCP treat them uniformly."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dparam = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
                mod.register_parameter(pname, nn.Parameter(dparam, requires_grad=param.requires_grad))

        def inputs(mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(
                DTensor.from_local(a, mesh, [Replicate()], run_check=False) if _is_plain(a) else a for a in args
            )

        def outputs(mod: nn.Module, out: object, mesh: DeviceMesh) -> object:
            return out.to_local() if isinstance(out, DTensor) else out

        # torch annotates output_fn as returning None, but distribute_module returns its result from a forward hook
        return distribute_module(module, device_mesh, partition, inputs, outputs)  # type: ignore[arg-type]


class ExpertTensorParallel(ParallelStyle):
    """An MoE layer (``engine.model.moe.MoELayer``) under TP, Megatron's default (expert tensor parallel size = TP).

    - Input: the tokens every rank routes (with sequence parallelism the ``Shard(1)`` stream all-gathered first).
    - Router: replicated weight on replicated tokens (``_Replicated``); routing, the aux loss and the router figures
      are the one-process ones on every rank.
    - Experts: run on their local pieces (``moe.local_weight``): rank k computes every expert's ``[gate_k; up_k]``
      and its slice of fc2, a partial sum of the output.
    - Output: the partial sums reduced (all-reduce; reduce-scatter onto the sequence dim with sequence parallelism,
      returned as the ``Shard(1)`` DTensor the residual stream is).

    Backward: each rank's gradient of the expert rows is a partial sum (its own FFN slice), so the input's gradient
    is declared ``Partial`` and reduced once per token (all-reduce, or reduce-scatter: Megatron's pair of
    all-gather / reduce-scatter around the experts), not once per routed (token, expert) row. The router's gradient
    is whole on every rank and joins that sum as one TP-th share per rank. The routing weights are applied to each
    rank's slice, so their gradient (N × k numbers) is all-reduced where they enter the experts; the router's weight
    gradient is then whole and equal on every rank, as its ``Replicate`` placement says."""

    def __init__(self, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        fc1_rows: Placement = StridedShard(1, split_factor=2)  # per expert [gate_k; up_k]
        self.placements: dict[str, Placement] = {
            "linear_fc1": fc1_rows,
            "linear_fc1.lora_A": Replicate(),
            "linear_fc1.lora_B": fc1_rows,
            "linear_fc2": Shard(2),
            "linear_fc2.lora_A": Shard(2),
            "linear_fc2.lora_B": Replicate(),
        }

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        router, experts = module.get_submodule("router"), module.get_submodule("experts")
        share = 1.0 / device_mesh.size()
        router.register_forward_pre_hook(lambda mod, args: (_ScaleGrad.apply(args[0], share),))  # before _Replicated's
        _Replicated()._apply(router, device_mesh)
        distribute_module(experts, device_mesh, self._partition, self._expert_inputs)  # type: ignore[arg-type]
        module.register_forward_pre_hook(lambda mod, args: (self._gather(args[0], device_mesh), *args[1:]))
        module.register_forward_hook(lambda mod, args, out: self._reduce(out, device_mesh))
        return module

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name not in self.placements:
            return
        param = module.get_parameter("weight")
        dparam = nn.Parameter(_place(param, mesh, self.placements[name]), requires_grad=param.requires_grad)
        module.register_parameter("weight", dparam)

    @staticmethod
    def _expert_inputs(module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        rows, counts, row_weight = args
        # identity; the gradient (a partial sum over this rank's FFN slice) all-reduced over TP
        whole = DTensor.from_local(row_weight, mesh, [Replicate()], run_check=False)
        return rows, counts, whole.to_local(grad_placements=[Partial()])

    def _gather(self, hidden: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(hidden, DTensor):  # without sequence parallelism every rank has every token already
            hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
        return hidden.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])

    def _reduce(self, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        partial_sum = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        if self.sequence_parallel:
            return partial_sum.redistribute(placements=[Shard(1)])
        return partial_sum.redistribute(placements=[Replicate()]).to_local()


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` (a rank's share of a whole gradient that a TP sum adds up)."""

    # ctx: Any: autograd's context, which carries what forward saves for backward (torch types it so)
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _is_plain(x: object) -> TypeGuard[torch.Tensor]:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


def _norm_style(sequence_parallel: bool) -> ParallelStyle:
    """Sequence parallel: the norm runs on this rank's sequence shard and returns it as a ``Shard(1)`` DTensor (the
    residual stream stays a DTensor with the global shape). Without it: replicated input, weight and output."""
    return SequenceParallel(use_local_output=False) if sequence_parallel else _Replicated()


def layer_plan(sequence_parallel: bool, moe: bool = False) -> dict[str, ParallelStyle]:
    """Plan for one decoder layer (module paths relative to the layer); ``moe``: its MLP is routed experts."""
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    mlp: dict[str, ParallelStyle] = {
        "mlp.linear_fc1": ColumnParallel(gate_up=True, input_layouts=seq),
        "mlp.linear_fc2": RowParallel(output_layouts=seq, use_local_output=not sp),
    }
    if moe:
        mlp = {"mlp": ExpertTensorParallel(sequence_parallel=sp)}
    return {
        "input_layernorm": _norm_style(sp),
        "self_attention.linear_qkv": ColumnParallel(input_layouts=seq),
        # (B, T, heads_local, d): heads are dim 2. Replicated weight on a head-sharded input -> all-reduced grad.
        "self_attention.q_layernorm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attention.k_layernorm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attention.linear_proj": RowParallel(output_layouts=seq, use_local_output=not sp),
        "pre_mlp_layernorm": _norm_style(sp),
        **mlp,
    }


def top_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for the embedding, final norm and head that exist on this (pipeline) stage."""
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "embedding", None) is not None:
        plan["embedding.word_embeddings"] = VocabParallelEmbedding(seq, use_local_output=not sp)
    if getattr(model.decoder, "final_layernorm", None) is not None:
        plan["decoder.final_layernorm"] = _norm_style(sp)
    if getattr(model, "output_layer", None) is not None:
        plan["output_layer"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> nn.Module:
    """Shard ``model`` (a whole ``Qwen3Model`` or a pipeline stage of it) over the 1-D ``tp_mesh`` in place."""
    lm = decoder_lm(model)
    layout.check(lm.cfg, layout.ParallelDims(tp=tp_mesh.size()))
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, top_plan(model, sequence_parallel))
    for layer in lm.decoder.layers.values():
        parallelize_module(layer, tp_mesh, layer_plan(sequence_parallel, isinstance(layer.mlp, MoELayer)))
    # SequenceParallel re-creates parameters with requires_grad=True (measured trap): restore the frozen set.
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return model


# ------------------------------------------------------------------ vocab-parallel cross-entropy


class _VocabParallelCE(torch.autograd.Function):
    """Per-token CE of logits sharded on the vocab dim (Megatron's ``_VocabParallelCrossEntropy``).

    Forward: global max (all-reduce MAX), target logit from the owning rank (all-reduce SUM), sum of exp
    (all-reduce SUM). Backward is local: softmax - one_hot on this rank's vocab slice."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        vocab_local = logits.shape[-1]
        in_range = (target >= vocab_start) & (target < vocab_start + vocab_local)
        local_idx = torch.where(in_range, target - vocab_start, torch.zeros_like(target))
        picked = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1) * in_range
        dist.all_reduce(picked, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - picked
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_idx, in_range)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        softmax, local_idx, in_range = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, local_idx.unsqueeze(-1), -in_range.unsqueeze(-1).to(g.dtype))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 256,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, num_tokens)`` of final hidden states against a vocab-sharded head, fp32, labels -100 ignored.

    ``hidden``: (B, T, H), a local replicated tensor or a sequence-sharded DTensor; ``weight``: the head as a DTensor
    ``Shard(0)`` on the TP mesh. Like ``chunked_cross_entropy``, only ``chunk_size`` rows of (local) logits exist at
    a time, and only labelled rows reach the head: ``rows`` (flat positions with a label, e.g. the batch's
    host-computed ``loss_index``) or, if not given, found here (one host sync). ``loss_sum`` is identical on every
    TP rank."""
    per_token, flat, _ = _token_losses(hidden, weight, labels, chunk_size, rows)
    labelled = flat != IGNORE_INDEX
    return (per_token * labelled).sum(), labelled.sum()


def vocab_parallel_sequence_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 256,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``engine.train.preference.sequence_logprobs`` against a vocab-sharded head: (summed log-probs (B,) fp32,
    labelled tokens (B,)), identical on every TP rank. Arguments as ``vocab_parallel_cross_entropy``. Unlike the
    single-device path, each chunk's softmax is kept for backward (``_VocabParallelCE``)."""
    b, t = labels.shape
    per_token, flat, rows = _token_losses(hidden, weight, labels, chunk_size, rows)
    labelled = flat != IGNORE_INDEX
    seq = torch.div(rows, t, rounding_mode="floor")
    sums = per_token.new_zeros(b).index_add(0, seq, -(per_token * labelled))
    return sums, torch.bincount(seq, weights=labelled.float(), minlength=b).long()


def vocab_parallel_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, rows: torch.Tensor
) -> torch.Tensor:
    """Each selected row's log p(label) (N,) fp32 against a vocab-sharded head, identical on every TP rank (stage
    grpo's per-token log-probs); arguments as ``vocab_parallel_cross_entropy``."""
    return -_token_losses(hidden, weight, labels, chunk_size, rows)[0]


@torch.no_grad()
def vocab_parallel_token_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Each selected row's entropy of softmax(h @ W^T) (N,) fp32 against a vocab-sharded head: per chunk the max,
    Σ exp and Σ exp·logit are completed over TP, so no rank holds more than its vocabulary slice."""
    weight = cast(DTensor, weight)
    group = weight.device_mesh.get_group()
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()]).to_local()
    h, w = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), weight.to_local()
    parts = []
    for start in range(0, h.shape[0], chunk_size):
        logits = (h[start : start + chunk_size] @ w.t()).float()
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top[:, None]
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
        dist.all_reduce(sums, group=group)
        parts.append(sums[0].log() - sums[1] / sums[0])  # H = log Z - E[shifted logit]
    return torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)


def vocab_parallel_row_logit_sums(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``engine.train.preference.row_logit_sums`` against a vocab-sharded head: the shards' column sums of the head
    are summed over TP (one H-sized collective), then each labelled position's ``h · Σ_v W_v`` per row; identical on
    every TP rank. Not differentiated."""
    weight = cast(DTensor, weight)
    mesh = weight.device_mesh
    b, t = labels.shape
    with torch.no_grad():
        w_sum = weight.to_local().float().sum(0)
        dist.all_reduce(w_sum, group=mesh.get_group())
        full = hidden.redistribute(placements=[Replicate()]).to_local() if isinstance(hidden, DTensor) else hidden
        h = full.reshape(-1, full.shape[-1])
        if rows is None:
            rows = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
        seq = torch.div(rows, t, rounding_mode="floor")
        per_token = h.index_select(0, rows).float() @ w_sum
        return torch.zeros(b, dtype=torch.float32, device=h.device).index_add(0, seq, per_token)


def _token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, rows: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE of each selected row (N,) fp32, its label (N,), the flat positions selected (N,))."""
    weight = cast(DTensor, weight)
    mesh = weight.device_mesh
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()])
    else:
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    # Each rank's dL/dh is a partial sum over its vocab slice: declare it Partial so DTensor reduces it.
    h = hidden.to_local(grad_placements=[Partial()]).reshape(-1, hidden.shape[-1])
    flat = labels.reshape(-1)
    if rows is None:
        rows = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    h, flat = h.index_select(0, rows), flat.index_select(0, rows)  # prompt and padding rows cost nothing
    w = weight.to_local()
    vocab_start = mesh.get_local_rank() * w.shape[0]
    group = mesh.get_group()
    parts = [
        _VocabParallelCE.apply(h[start : start + chunk_size] @ w.t(), tgt.clamp(min=0), vocab_start, group)
        for start in range(0, h.shape[0], chunk_size)
        for tgt in [flat[start : start + chunk_size]]
    ]
    # no labelled row (a context-parallel slice of prompt tokens only): a zero-length loss still in the graph, so
    # backward runs (and meets its peers' collectives) like on every other rank
    per_token = torch.cat(parts) if parts else h.sum(dim=1).float() * 0.0
    return per_token, flat, rows


# ------------------------------------------------------------------ checkpoint view


def _nested_strided(value: torch.Tensor) -> bool:
    """FSDP over a TP ``[gate_k; up_k]`` shard: ``_StridedShard`` on the FSDP (first) mesh dim over a
    ``_StridedShard`` on tp (the fc1 of a dense MLP under TP × DP, an expert fc1 under EP × TP). DTensor's own
    redistribution misplaces those rows (measured on TP2 × DP2: half of fc1 wrong in ``full_tensor``, and a
    checkpoint that resumed elsewhere with other losses), so they are assembled here by their construction: the
    FSDP chunks (``torch.chunk`` on dim 0) of the tensor the inner placements give."""
    if not isinstance(value, DTensor) or len(value.placements) < 2:
        return False
    first, rest = value.placements[0], value.placements[1:]
    return isinstance(first, StridedShard) and any(isinstance(p, StridedShard) for p in rest)


def _inner_mesh(mesh: DeviceMesh) -> DeviceMesh:
    names = mesh.mesh_dim_names or ()
    return mesh[names[1:]] if len(names) > 2 else mesh[names[1]]


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of ``value`` (collective over its mesh when it is a DTensor; ``_nested_strided`` ones too)."""
    if not isinstance(value, DTensor):
        return value
    if not _nested_strided(value):
        return value.full_tensor()
    placements, mesh, inner = value.placements, value.device_mesh, _inner_mesh(value.device_mesh)
    rows = compute_local_shape_and_global_offset(value.shape, inner, placements[1:])[0][0]
    local = value.to_local()
    step = -(-rows // mesh.size(0))
    padded = local.new_zeros(step, *local.shape[1:])
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(mesh.size(0))]
    dist.all_gather(pieces, padded, group=mesh.get_group(0))
    inner_local = torch.cat(pieces)[:rows]  # every chunk but the trailing ones holds ``step`` rows
    whole = DTensor.from_local(
        inner_local, inner, placements[1:], run_check=False, shape=value.shape, stride=value.stride()
    )
    return whole.full_tensor()


def _plain_copy(value: DTensor, plain: list[Placement]) -> DTensor:
    """``value`` (``_nested_strided``) as a DTensor with the ``plain`` placements of the same global tensor."""
    full = full_tensor(value.detach())
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, plain)
    local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].clone()
    return DTensor.from_local(
        local, value.device_mesh, plain, run_check=False, shape=value.shape, stride=value.stride()
    )


def _write_full(original: DTensor, full: torch.Tensor) -> None:
    """Write the whole tensor ``full`` into ``original``'s local piece (``_nested_strided``)."""
    mesh, inner = original.device_mesh, _inner_mesh(original.device_mesh)
    replicated = DTensor.from_local(full, inner, [Replicate()] * inner.ndim, run_check=False)
    inner_local = replicated.redistribute(placements=original.placements[1:]).to_local()
    chunks, rank = inner_local.chunk(mesh.size(0), dim=0), mesh.get_local_rank(0)
    original.to_local().copy_(chunks[rank] if rank < len(chunks) else inner_local[:0])


def dcp_view(
    state: dict[str, Any],  # Any: a model + optimizer state tree (tensors, numbers, FQN lists), as DCP types it
) -> tuple[dict[str, Any], Callable[[], None]]:  # Any: as state
    """Make a (nested) state dict storable by DCP, plus a function that copies loaded values back.

    DCP stores one contiguous chunk per rank, so a ``_StridedShard`` tensor (fc1's ``[gate_k; up_k]``) is replaced
    by a copy redistributed to ``Shard(dim)`` of the *same global tensor*. The checkpoint therefore holds the
    native global layout and loads under any TP/PP/DP layout. After ``dcp.load`` into the view, call the returned
    function to write the values back into the strided originals (a no-op after ``dcp.save``)."""
    pairs: list[tuple[DTensor, DTensor]] = []

    def convert(value: object) -> object:
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, DTensor) and any(isinstance(p, StridedShard) for p in value.placements):
            plain = [Shard(p.dim) if isinstance(p, StridedShard) else p for p in value.placements]
            if _nested_strided(value):
                copy = _plain_copy(value, plain)
            else:
                copy = cast(DTensor, value.detach()).redistribute(placements=plain)
            pairs.append((value, copy))
            return copy
        return value

    def restore() -> None:
        with torch.no_grad():
            for original, copy in pairs:
                if _nested_strided(original):
                    _write_full(original, copy.full_tensor())
                else:
                    original.copy_(copy.redistribute(placements=original.placements))

    view = convert(state)
    assert isinstance(view, dict)  # a dict converted is a dict
    return view, restore
