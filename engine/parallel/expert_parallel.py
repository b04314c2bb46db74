"""Expert parallelism: each MoE layer's experts split over the ``ep`` ranks, tokens sent to them with all-to-all.

Mesh (torchtitan ``ParallelDims.build_mesh``, Megatron's expert-data-parallel group): EP is carved out of data
parallel. The ``dp`` dimension of the dp × pp × tp mesh is unflattened into ``edp`` × ``ep`` (ep varies fastest, so
an EP group is ``ep`` neighbouring DP ranks of one pipeline stage and one TP rank); every view shares the root mesh,
so FSDP and DTensor accept them together. Non-expert weights stay FSDP-sharded over all of ``dp``; the stacked
expert weights (E, out, in) and their LoRA adapters are DTensors ``Shard(0)`` over ``ep`` (E/EP experts per rank,
never replicated over EP) that FSDP then shards over ``edp`` (``engine.parallel.data_parallel.apply_fsdp``).

With tensor parallelism (applied first, ``engine.parallel.tensor_parallel.ExpertTensorParallel``; Megatron's expert
tensor parallel size = TP, torchtitan's ``apply_moe_ep_tp``) an expert weight is a 2-D DTensor over (ep, tp):
``Shard(0)`` on ep and its TP placement on tp. Every TP rank routes the same tokens, and TP rank t of one EP group
exchanges rows only with TP rank t of the others, so each (token, expert) row reaches each TP slice of its expert
once; the slices' partial outputs are summed over TP after the combine, as without EP. With pipeline parallelism
each stage's DP ranks form its own EP groups; they run the same micro-batch schedule, so their all-to-alls meet.

Dispatch (``--moe-token-dispatcher-type alltoall``; Megatron's ``MoEAlltoAllTokenDispatcher``): the router runs on
each rank's own tokens (so capacity dropping, the aux loss and the router figures are those of one process on the
same micro-batch), the layer sorts the (token, choice) rows by expert, and the hooks here wrap the expert module:
exchange the per-expert row counts, send each rank the rows of its experts (``all_to_all_single``, differentiable),
regroup the received rows by local expert, run the grouped matmuls on the local experts, undo the regrouping and send
the rows back. ``allgather`` runs the same exchange: with top-k routing both give the same numbers, and all-to-all
moves only the rows each rank needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from engine.contract import layout
from engine.model.moe import GroupedExperts, moe_layers
from engine.torch_compat import all_to_all_single_autograd, unflatten_mesh, wait_tensor

EP_DIMS = ("edp", "ep")


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The (edp, ep, pp, tp) view of the (dp, pp, tp) ``mesh`` (collective over every rank: creates the process
    groups, so every rank calls it the same number of times, whether or not its stage holds an MoE layer)."""
    dims = layout.ParallelDims(dp=mesh["dp"].size(), ep=ep)  # LayoutError unless EP divides DP
    return unflatten_mesh(mesh, (dims.dp // ep, ep), EP_DIMS, dim=list(mesh.mesh_dim_names or ()).index("dp"))


@dataclasses.dataclass
class _Exchange:
    """What the combine step needs from the dispatch of the same forward."""

    sent: list[int]  # rows sent to each EP rank
    received: list[int]  # rows received from each EP rank
    order: torch.Tensor  # received rows -> local-expert order


class AllToAllDispatch:
    """The forward pre-hook and hook that move an expert module's rows to their experts' ranks and back."""

    def __init__(self, group: dist.ProcessGroup, num_local: int) -> None:
        self.group, self.num_local = group, num_local
        self.ep = dist.get_world_size(group)
        self.pending: list[_Exchange] = []  # a stack: activation recompute may nest a forward in backward

    def dispatch(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """(rows sorted by global expert, counts (E,), row weights) -> the same for this rank's experts."""
        x, counts, row_weight = args
        send_counts = counts.reshape(self.ep, self.num_local)  # [dest rank, its local expert]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [source rank, my local expert]
        sent = send_counts.sum(1).tolist()  # host sync: the splits are sizes
        received = recv_counts.sum(1).tolist()
        rows = torch.cat([x, row_weight.to(x.dtype)], dim=1)  # one exchange for the rows and their weights
        rows = wait_tensor(all_to_all_single_autograd(rows, received, sent, self.group))
        # received: blocks by (source, local expert); the grouped matmul wants them by (local expert, source)
        block = torch.arange(self.ep * self.num_local, device=x.device)
        block = torch.repeat_interleave(block, recv_counts.reshape(-1), output_size=rows.shape[0])
        order = torch.argsort((block % self.num_local) * self.ep + block // self.num_local, stable=True)
        self.pending.append(_Exchange(sent, received, order))
        rows = rows.index_select(0, order)
        width = x.shape[1]
        return rows[:, :width], recv_counts.sum(0), rows[:, width:].to(row_weight.dtype)

    def combine(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        """This rank's expert outputs -> the rows the calling rank sent, in its order."""
        ex = self.pending.pop()
        back = torch.empty_like(out).index_copy(0, ex.order, out)
        return wait_tensor(all_to_all_single_autograd(back, ex.sent, ex.received, self.group))


def _ep_shard(param: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """``param`` (a plain tensor, or a DTensor over ``tp``) -> ``Shard(0)`` over ``ep`` (then its TP placement over
    ``tp``): this rank keeps only its experts' rows of its local piece (on the meta device nothing is read or sent)."""
    ep_mesh = mesh["ep"]
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    if isinstance(param, DTensor):  # TP applied first: cut the local (TP) piece's experts, keep the TP placement
        local = param.to_local().detach().chunk(ep, dim=0)[rank].clone()
        placements = [Shard(0), *param.placements]
        return DTensor.from_local(
            local, mesh["ep", "tp"], placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    local = param.detach().chunk(ep, dim=0)[rank].clone()  # its own storage: the whole tensor can go
    return DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)


def _shard_experts(experts: GroupedExperts, mesh: DeviceMesh) -> None:
    """Every stacked (E, ...) parameter of ``experts`` (base weights and LoRA adapters) -> ``_ep_shard``."""
    for owner in list(experts.modules()):
        for name, param in list(owner.named_parameters(recurse=False)):
            setattr(owner, name, nn.Parameter(_ep_shard(param, mesh), requires_grad=param.requires_grad))
    # LoRAStacked shares its base weight with the StackedWeight it replaced; that module is no longer in the tree.


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, context: DeviceMesh | None = None) -> None:
    """Split every MoE layer's experts over the ``ep`` dimension of ``mesh`` (``expert_mesh``) and route their rows
    with all-to-all over it (in place). ``context``: the CP ranks, whose expert gradients ``reduce_over_context``
    completes."""
    ep_mesh = mesh["ep"]
    ep = ep_mesh.size()
    for layer in moe_layers(model).values():
        layer.experts.context_group = None if context is None else context.get_group()
        layout.check(layout.Shape(num_experts=layer.num_experts), layout.ParallelDims(dp=ep, ep=ep))
        _shard_experts(layer.experts, mesh)
        layer.experts.gathers_rows = False  # the hooks below exchange gathered rows
        hooks = AllToAllDispatch(ep_mesh.get_group(), layer.num_experts // ep)
        layer.experts.register_forward_pre_hook(hooks.dispatch)
        layer.experts.register_forward_hook(hooks.combine)


def reduce_over_context(model: nn.Module) -> None:
    """Under context parallelism with EP, sum each expert weight's gradient over the CP ranks (call after backward,
    before the gradient norm). EP is carved out of DP, so FSDP shards the experts over the EDP ranks only; the CP ranks
    of an EDP rank hold the same expert shards and routed different tokens to them (their other weights reduce over
    DP × CP through FSDP). A DTensor's mesh cannot pair EDP × CP with EP in rank order, hence this separate sum."""
    for module in model.modules():
        group = getattr(module, "context_group", None) if isinstance(module, GroupedExperts) else None
        if group is None:
            continue
        for param in module.parameters():
            if param.grad is not None:
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                dist.all_reduce(grad, group=group)
