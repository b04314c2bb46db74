"""Every private torch name the engine uses, in one place, so a torch upgrade that drops or changes one breaks here
(and in tests/unit/engine/test_torch_compat.py, one test per name) rather than deep inside a training run.

Pinned torch: 2.13 (pyproject). Each name, and why no public API does the job:

- ``torch.distributed.tensor.placement_types._StridedShard``: the placement FSDP2 gives a parameter already sharded
  on dim 0 by TP, and the one our fused ``[gate; up]`` fc1 uses so that a TP rank holds ``[gate_k; up_k]``; DTensor
  exposes no public strided placement.
- ``torch.distributed.checkpoint._traverse.set_element``: how DCP's ``DefaultLoadPlanner.load_bytes`` puts a
  non-tensor item back into a nested state dict; ``SafeLoadPlanner`` overrides that method and must do the same.
- ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper``: per-block activation
  checkpointing with the ``_checkpoint_wrapped_module.`` key prefix that FSDP2 and DCP state dicts understand
  (``torch.utils.checkpoint`` is public but wraps a call, not a module).
- ``torch.distributed.tensor.parallel.ColwiseParallel._prepare_output_fn`` / ``._prepare_input_fn`` and
  ``ParallelStyle._apply``: the hooks a custom ``ParallelStyle`` is built from (PyTorch's own styles are written
  this way; there is no public extension API). ``_apply`` is overridden in ``engine.parallel.tensor_parallel``.
- ``torch._C._current_graph_task_id``: -1 outside autograd's backward; tells an activation-checkpoint recompute
  (inside backward) from the real forward, so MoE router statistics are counted once.
- ``torch._foreach_mul_``: one fused kernel to unscale every gradient (what ``torch.amp.GradScaler`` uses).
- ``torch._utils._rebuild_tensor_v2``: the callable ``torch.save`` pickles for a tensor; our streaming
  ``TorchFileWriter`` must pickle the same so ``torch.load`` reads its files.
- ``torch.storage._LegacyStorage``: the base of the typed ``torch.*Storage`` classes an old checkpoint pickle names.
- ``torch.distributed._functional_collectives.all_to_all_single_autograd`` / ``wait_tensor``: the differentiable
  all-to-all of expert parallelism's token dispatch (works on gloo; the public ``torch.distributed.nn.functional``
  variant is deprecated in its favour).
- ``DeviceMesh._unflatten``: the (edp, ep) view of the ``dp`` mesh dimension sharing its root mesh, which FSDP and
  DTensor need to accept expert and dense parameters together (torchtitan builds its meshes the same way).
- ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: which rows of a DTensor a rank holds
  under any placements (FSDP's strided shards of EP-sharded experts included), so it reads only those.
- ``torch.ops.profiler._record_function_enter_new`` / ``_record_function_exit``: the profiler-marker ops that
  selective activation checkpointing must ignore, and ``torch.ops._c10d_functional.all_to_all_single``: the
  expert-parallel exchange it keeps rather than sends again in the recompute
  (``engine.parallel.activation_checkpoint``).

Not here because a public API does it: the MoE expert matmul uses ``torch.nn.functional.grouped_mm`` (a thin public
wrapper of ``torch._grouped_mm``); single-process DCP reads use ``torch.distributed.checkpoint.load(no_dist=True)``
(``engine.checkpoint.dcp.read_saved``), not ``_load_state_dict_from_keys``. Strings such as ``"torch._utils"`` in the
unpickling allow-list (``engine.contract.allow_list``, used by ``safe_pickle`` and ``reader``) name what a pickle holds and
are not imports.
"""

from __future__ import annotations

import torch
from torch import _C as _torch_C
from torch import _foreach_mul_ as foreach_mul_
from torch._utils import _rebuild_tensor_v2 as rebuild_tensor_v2
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.storage import _LegacyStorage as LegacyStorage

# (module, attribute path) of every private name above; the unit test resolves each one separately.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("torch.distributed.tensor.placement_types", "_StridedShard"),
    ("torch.distributed.checkpoint._traverse", "set_element"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),
    ("torch.distributed.tensor.parallel", "ColwiseParallel._prepare_output_fn"),
    ("torch.distributed.tensor.parallel", "ColwiseParallel._prepare_input_fn"),
    ("torch.distributed.tensor.parallel", "ParallelStyle._apply"),
    ("torch._C", "_current_graph_task_id"),
    ("torch", "_foreach_mul_"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_LegacyStorage"),
    ("torch.distributed._functional_collectives", "all_to_all_single_autograd"),
    ("torch.distributed._functional_collectives", "wait_tensor"),
    ("torch.distributed.device_mesh", "DeviceMesh._unflatten"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch", "ops.profiler._record_function_enter_new.default"),
    ("torch", "ops.profiler._record_function_exit._RecordFunction"),
    ("torch", "ops._c10d_functional.all_to_all_single.default"),
)

ALL_TO_ALL_OP = torch.ops._c10d_functional.all_to_all_single.default

PROFILER_MARKER_OPS = (
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
)


def unflatten_mesh(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...], dim: int = 0) -> DeviceMesh:
    """``mesh`` with dimension ``dim`` viewed as ``sizes`` named ``names``, on the same root mesh (creates the
    process groups)."""
    return mesh._unflatten(dim, sizes, names)


colwise_prepare_output_fn = ColwiseParallel._prepare_output_fn


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. an activation-checkpoint recompute)."""
    return bool(_torch_C._current_graph_task_id() != -1)


__all__ = [
    "ALL_TO_ALL_OP",
    "PRIVATE_NAMES",
    "PROFILER_MARKER_OPS",
    "LegacyStorage",
    "StridedShard",
    "all_to_all_single_autograd",
    "checkpoint_wrapper",
    "colwise_prepare_output_fn",
    "compute_local_shape_and_global_offset",
    "foreach_mul_",
    "in_backward",
    "rebuild_tensor_v2",
    "set_element",
    "unflatten_mesh",
    "wait_tensor",
]
