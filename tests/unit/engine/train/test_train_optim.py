"""The AdamW step (engine.train.optim): fused where the device has the kernel, else foreach in bounded groups."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.contract.spec import parse_spec
from engine.parallel.device import has_fused_adamw
from engine.train.optim import bounded_groups, build_optimizer, param_groups


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 32))


def _spec() -> Any:
    return parse_spec({"kind": "train", "data_path": ["d"], "train_iters": 1, "lr": 1e-2, "seq_length": 8})


def _steps(opt: torch.optim.Optimizer, model: nn.Module) -> list[torch.Tensor]:
    for i in range(3):
        torch.manual_seed(i)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_cpu_step_is_fused_and_matches_foreach() -> None:
    assert has_fused_adamw("cpu")
    fused_model, foreach_model = _model(), _model()
    fused = build_optimizer(fused_model, _spec())
    assert fused.defaults["fused"]
    spec = _spec()
    foreach = torch.optim.AdamW(
        param_groups(foreach_model, spec.weight_decay),
        lr=1e-2,
        betas=(spec.adam_beta1, spec.adam_beta2),
        eps=spec.adam_eps,
        foreach=True,
    )
    for a, b in zip(_steps(fused, fused_model), _steps(foreach, foreach_model), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_bounded_groups_keep_each_foreach_temporary_under_the_limit() -> None:
    model = _model()
    groups = [{"params": list(model.parameters()), "weight_decay": 0.1}]
    limit = 128 * 64 * 4  # the first weight alone fills a group
    pieces = bounded_groups(groups, limit)
    assert [p for g in pieces for p in g["params"]] == list(model.parameters())  # every parameter once, in order
    assert len(pieces) > 1 and all(g["weight_decay"] == 0.1 for g in pieces)
    for g in pieces:
        size = sum(p.numel() * 4 for p in g["params"])
        assert size <= limit or len(g["params"]) == 1
