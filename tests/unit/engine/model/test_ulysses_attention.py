"""Ulysses attention (``engine.parallel.context_parallel``) inside a Qwen3 ``SelfAttention`` on 2 gloo processes:
each rank's output and gradients (its tokens' input gradient, the weights' gradients summed over the ranks) equal
one process's over the whole sequence, and the output projection's token-major input is freed from the forward
until its backward (rebuilt there by the all-to-all again), unless activation checkpointing turned that off."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from engine.contract.model_config import ModelConfig
from engine.model.attention import AttentionPlan
from engine.model.qwen3 import SelfAttention
from engine.model.rope import rope_cos_sin
from engine.parallel.context_parallel import UlyssesAttention

CFG = ModelConfig(1, 32, 64, 4, 2, 8, vocab_size=64, max_position_embeddings=64)
T = 16


def _module() -> SelfAttention:
    torch.manual_seed(0)
    module = SelfAttention(CFG).double()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return module


def _run(module: SelfAttention, x: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor) -> tuple:
    x = x.clone().requires_grad_()
    saved: list[torch.Tensor] = []
    hook = module.linear_proj.register_forward_hook(lambda _m, args, _out: saved.append(args[0]))
    out = module(x, rope_cos_sin(positions, CFG, torch.float64), AttentionPlan())
    hook.remove()
    freed = saved[0].untyped_storage().nbytes() == 0
    (out * weight).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}  # type: ignore[union-attr]
    return out.detach(), x.grad, grads, freed


def _rank(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)  # as torchrun's ranks (OMP_NUM_THREADS=1): two ranks x two threads on two cores thrash
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(1, T, CFG.hidden_size, generator=gen, dtype=torch.float64)
        weight = torch.randn(1, T, CFG.hidden_size, generator=gen, dtype=torch.float64)
        positions = torch.arange(T)[None]
        want = _run(_module(), x, positions, weight)
        for free in (True, False):
            _check(rank, world, free, x, positions, weight, want)
    finally:
        dist.destroy_process_group()


def _check(
    rank: int, world: int, free: bool, x: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, want: tuple
) -> None:
    want_out, want_dx, want_grads, _ = want
    module = _module()
    module.attend = UlyssesAttention(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    module.free_attention_output = free
    mine = slice(rank * T // world, (rank + 1) * T // world)
    out, dx, grads, freed = _run(module, x[:, mine], positions[:, mine], weight[:, mine])
    assert freed == free, free
    torch.testing.assert_close(out, want_out[:, mine], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, want_dx[:, mine], rtol=1e-12, atol=1e-12)
    for name, grad in grads.items():
        dist.all_reduce(grad)  # each rank's share of the weights' gradient: its own tokens'
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-10, atol=1e-12, msg=f"{name} free={free}")


def test_ulysses_frees_the_projection_input_and_equals_one_process(tmp_path: Path) -> None:
    """Both settings of ``free_attention_output`` in one pair of processes: the spawn (two interpreters importing
    torch) is most of the cost, the attention itself milliseconds."""
    mp.spawn(_rank, args=(2, str(tmp_path / "store")), nprocs=2, join=True)
