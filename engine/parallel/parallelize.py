"""The one ordered entry that turns a plain ``Qwen3Model`` into the model a rank trains.

Order (torchtitan ``models/qwen3/infra/parallelize.py``): storage dtypes (``engine.parallel.precision``) ->
tensor/sequence parallel -> expert parallel -> activation checkpointing -> compile -> data parallel (with the mixed-precision policy). Each step is an ``apply_*`` helper; the model file knows nothing of ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from engine.contract.spec import TrainSpec
from engine.model.moe import moe_layers
from engine.parallel.activation_checkpoint import apply_ac
from engine.parallel.context_parallel import apply_context_parallel
from engine.parallel.data_parallel import apply_fsdp
from engine.parallel.expert_parallel import apply_expert_parallel, expert_mesh
from engine.parallel.mesh import batch_mesh, context_mesh
from engine.parallel.precision import apply_param_dtypes, compute_dtype, param_dtypes
from engine.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["compute_dtype", "parallelize"]


def parallelize(model: nn.Module, mesh: DeviceMesh, spec: TrainSpec) -> nn.Module:
    """Apply, in order, TP/SP, CP, EP, activation checkpointing, compile and FSDP2 to ``model`` (in place;
    returned)."""
    # Under pipeline parallelism ``model`` is one stage's part (engine.parallel.pipeline_parallel.build_pipeline).
    dtypes = param_dtypes(spec)
    apply_param_dtypes(model, dtypes)  # fp32 main weights; a frozen (LoRA) base stored once in the compute dtype
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=spec.sequence_parallel)
    if context_mesh(mesh) is not None:
        apply_context_parallel(model, mesh, spec.context_parallel_algo, spec.use_cp_send_recv_overlap)
    ep = spec.expert_model_parallel_size
    edp_mesh = None
    if ep > 1:
        experts_mesh = expert_mesh(mesh, ep)  # on every rank: a pipeline stage may hold no MoE layer
        if moe_layers(model):
            apply_expert_parallel(model, experts_mesh, context_mesh(mesh))
            edp_mesh = experts_mesh["edp"]
    if spec.recompute:
        apply_ac(model, spec.recompute, spec.recompute_method, spec.recompute_num_layers)
    # compile: not applied yet (CPU CI); it would go here, per decoder layer, after AC and before FSDP.
    dtype = dtypes.compute
    dp = batch_mesh(mesh)  # DP, times CP: the ranks holding different tokens reduce their gradients together
    # One process in fp32 needs no sharding and no casts: keep the plain module (fastest on CPU). Otherwise FSDP2
    # shards main weights, fp32 grads and Adam states over DP (× CP) and casts each layer to the compute dtype just in
    # time.
    if dp.size() > 1 or dtype != torch.float32:  # EP > 1 implies DP > 1
        # Pipeline stages run several micro-batches per step: resharding after each forward would re-gather the
        # parameters per micro-batch, so stages keep them (docs/torch-distributed-on-gloo.md, PP × FSDP2 recipe).
        reshard = spec.use_distributed_optimizer and mesh["pp"].size() == 1
        apply_fsdp(
            model,
            dp,
            param_dtype=None if dtype == torch.float32 else dtype,
            reshard_after_forward=reshard,
            edp_mesh=edp_mesh,
        )
    return model
