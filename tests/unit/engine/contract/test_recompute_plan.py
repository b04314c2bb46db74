"""MindSpeed's recompute flags: accepted on the command line and in specs, checked, planned, and the planned bytes
met by what a layer really keeps (counted as bench/activations.py counts them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from test_plan import seed_full

from engine.contract.flags import spec_from_argv
from engine.contract.model_config import preset
from engine.contract.plan import plan_spec
from engine.contract.plan.memory import layer_activation_bytes
from engine.contract.spec import parse_spec

ROOT = Path(__file__).resolve().parents[4]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_activations", ROOT / "bench" / "activations.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_reach_the_spec() -> None:
    argv = ["--data-path", "d", "--train-iters", "1", "--lr", "0.1", "--recompute-granularity", "full"]
    argv += ["--recompute-method", "block", "--recompute-num-layers", "3", "--recompute-activation-function"]
    argv += ["--recompute-activation-function-num-layers", "2"]
    spec, _, ignored = spec_from_argv("train", argv)
    assert not ignored
    assert (spec.recompute_granularity, spec.recompute_method, spec.recompute_num_layers) == ("full", "block", 3)
    assert spec.recompute_activation_function and spec.recompute_activation_function_num_layers == 2


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"recompute_method": "block"}, "recompute_method"),
        ({"recompute_granularity": "selective", "recompute_method": "uniform"}, "recompute_method"),
        ({"recompute_activation_function_num_layers": 2}, "recompute_activation_function_num_layers"),
        ({"recompute_granularity": "partial"}, "recompute_granularity"),
    ],
)
def test_bad_recompute_settings_name_the_field(extra: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        parse_spec(seed_full(**extra))


def test_each_mode_is_planned() -> None:
    """Per rank 0 (18 layers, 2 micro-batches in flight): block keeps N layers' inputs and the rest whole."""
    act = {
        name: plan_spec(parse_spec(seed_full(**extra))).ranks[0].activations
        for name, extra in {
            "none": {},
            "activation_function": {"recompute_activation_function": True},
            "selective": {"recompute_granularity": "selective"},
            "full": {"recompute_granularity": "full"},
            "uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
            "block6": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 6},
        }.items()
    }
    assert act["activation_function"] == act["none"]  # the engine always recomputes the SwiGLU product
    assert act["full"] == act["uniform"] < act["block6"] < act["none"]
    assert act["full"] < act["selective"] < act["none"]
    plan = plan_spec(parse_spec(seed_full()))
    whole = layer_activation_bytes(plan.cfg, plan.layout, plan.layout.tokens)
    boundary = plan.layout.tokens * 2 * plan.cfg.hidden_size  # a recomputed layer keeps its bf16 input
    assert act["block6"] - act["full"] == 2 * 12 * (whole - boundary)  # 12 layers kept whole, 2 micro-batches


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("model,device", [("qwen3-tiny", "meta"), ("qwen3-moe-tiny", "cpu")])
def test_planned_bytes_are_what_the_layer_keeps(mode: str, model: str, device: str, monkeypatch) -> None:  # noqa: ANN001
    bench = _bench()
    monkeypatch.setattr(F, "scaled_dot_product_attention", bench._fused_sdpa)
    cfg = preset(model)
    if cfg.moe_layers:
        cfg = cfg.replace(moe_layer_freq=1)  # every layer MoE: the planner's largest layer is the one measured
    torch.manual_seed(0)
    measured = bench.measure_ours(cfg, device, mode, 64)
    assert bench.planned(cfg, mode, 64) == pytest.approx(measured, rel=0.05)
