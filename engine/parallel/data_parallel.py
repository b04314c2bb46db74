"""Data parallelism: FSDP2 ``fully_shard`` over the ``dp`` mesh dimension (ZeRO-style sharded optimizer).

Every rank keeps only its shard of the fp32 master weights, gradients and Adam state (docs/torch-distributed-on-gloo.md:
FSDP2 on gloo matches one process). Compute runs in ``param_dtype`` (bf16/fp16) with fp32 gradient reduction
(``MixedPrecisionPolicy``); the dtypes are decided in ``engine.parallel.precision``. ``use_distributed_optimizer`` picks how parameters live between forward and backward:

- on  (ZeRO-3): parameters are resharded after forward and gathered again in backward — least memory;
- off (ZeRO-2): gathered parameters stay until backward — one all-gather per step less, more memory.

Both shard optimizer state; plain replicated DDP would only add memory on every rank, so it is not offered.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from engine.model.decoder_lm import decoder_lm
from engine.model.moe import moe_layers


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool = True,
    edp_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard each decoder layer, then the root (embedding, final norm, output layer) as its own group.

    ``edp_mesh`` (expert parallelism): each MoE layer's experts, already split over ``ep`` (DTensors), are their own
    group sharded over the expert-data-parallel ranks; the rest of the layer shards over all of ``dp_mesh``.

    Parameters keep their storage dtype (``engine.parallel.precision``: fp32 trainable, a frozen base possibly in
    ``param_dtype`` already); compute sees ``param_dtype`` copies; gradients are reduced and kept in fp32."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # One DP rank: sharding a frozen parameter (LoRA's base, already in the compute dtype) saves nothing, and FSDP
    # would keep its unsharded all-gather output next to it, a second copy of the base (2.2 GB per 4B PP stage).
    frozen = {p for p in model.parameters() if not p.requires_grad} if dp_mesh.size() == 1 else None
    layers = list(decoder_lm(model).decoder.layers.values())
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed first in backward: keep them gathered (torchtitan does the same).
        last = i == len(layers) - 1
        for moe in moe_layers(layer).values() if edp_mesh is not None else ():  # first: nested groups are skipped
            fully_shard(
                moe.experts,
                mesh=edp_mesh,
                mp_policy=mp,
                reshard_after_forward=reshard_after_forward and not last,
                ignored_params=frozen,
            )
        fully_shard(
            layer,
            mesh=dp_mesh,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward and not last,
            ignored_params=frozen,
        )
    # The root group (embedding, final norm, output layer) stays gathered from forward to backward: the trainer's
    # chunked loss reads the head matrix (``model.output_weight()``) after forward returns.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=frozen)
    # The trainer divides the summed loss by the global token count itself: FSDP must sum, not average, over ranks.
    # The setter only reaches the module's own parameter group, hence the loop over every sharded module.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives (no PREMUL_SUM, which gloo lacks; NCCL is zero-copy only for SUM anyway).
            module.set_force_sum_reduction_for_comms(True)
    return model


def reshard_all(modules: Iterable[nn.Module]) -> None:
    """Free the gathered parameters of every FSDP group under ``modules``. A forward-only pass leaves the groups kept
    gathered after forward (``reshard_after_forward=False``: each stage's last layer, the root) gathered, with no
    backward to reshard them: training that followed such a pass through a pipeline (stage dpo's reference pass)
    drifted from one process from its second step, and resharding after the pass makes it equal again. torch's
    pipeline schedule does the same after its own forward of metadata inference."""
    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
