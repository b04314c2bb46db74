"""The NPU RMSNorm under TP (``lean_ops._npu_rms_norm_local``: torch_npu's kernel on DTensors' local tensors, as
DTensor has no sharding strategy for it) on 2 gloo processes, the engine's ``RMSNormFunction`` standing in for the
kernel: output and gradients equal one process's, the weight's gradient summed over the ranks where x is sharded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from engine.model.lean_ops import RMSNormFunction, _npu_rms_norm_local

EPS = 1e-6


def _kernel(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, None]:
    return RMSNormFunction.apply(x, gamma, epsilon), None  # npu_rms_norm's (y, rstd)


def _rank(rank: int, world: int, store: str, placement: Placement) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(1)
        x, dy = (torch.randn(2, 8, 16, generator=gen, dtype=torch.float64) for _ in range(2))
        w = torch.rand(16, generator=gen, dtype=torch.float64) + 0.5
        ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
        want = RMSNormFunction.apply(ref_x, ref_w, EPS)
        (want * dy).sum().backward()

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        dx_ = distribute_tensor(x, mesh, [placement]).requires_grad_()
        dw_ = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
        out = _npu_rms_norm_local(_kernel, dx_, dw_, EPS)
        assert isinstance(out, DTensor) and out.placements == (placement,)
        (out * distribute_tensor(dy, mesh, [placement])).sum().backward()
        grads: list[Any] = [dx_.grad, dw_.grad]
        torch.testing.assert_close(out.full_tensor(), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grads[0].full_tensor(), ref_x.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grads[1].full_tensor(), ref_w.grad, rtol=1e-10, atol=1e-12)
        with pytest.raises(ValueError, match="rms_norm: x must be replicated or sharded off its last dim"):
            _npu_rms_norm_local(_kernel, distribute_tensor(x, mesh, [Shard(2)]), dw_, EPS)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("placement", [Shard(1), Replicate()], ids=["sequence_sharded", "replicated"])
def test_npu_norm_on_local_tensors_equals_one_process(tmp_path: Path, placement: Placement) -> None:
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), placement), nprocs=2, join=True)
