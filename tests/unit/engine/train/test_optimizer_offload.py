"""Optimizer CPU offload (issue 42): the offloaded share is stepped from its own host copy of the master and moments
with the device path's arithmetic, so on CPU the offloaded and the plain step are bit-identical; the split follows
Megatron's (leading parameters up to the fraction of elements); a run with offload resumes bit-identically."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from test_precision_optimizer import (  # noqa: E402
    CASES,
    PRECISION_AWARE,
    _problem,
    _run,
    data,  # noqa: F401 - the module's fixture
    resume_is_bit_identical,
)

from engine.train.precision_optimizer import HOST, StateDtypes, offloaded_params  # noqa: E402


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offloaded_step_equals_the_device_step(case: str, fraction: float):
    param_dtype, dtypes = CASES[case]
    plain, grads = _problem(param_dtype)
    offloaded, _ = _problem(param_dtype)
    _run(plain, grads, dtypes)
    opt = _run(offloaded, grads, dtypes, offload=fraction)
    moved = [p for p in offloaded if opt.on_host(p)]
    assert moved and (len(moved) == 3) == (fraction == 1.0)
    for p in moved:  # the host keeps its own master (the weights are only its rounded copy-back)
        state = opt.state[p]
        assert state["main_param"].dtype == dtypes.main_param
        assert {state[k].device for k in ("main_param", "exp_avg", "exp_avg_sq")} == {HOST}
    for a, b in zip(plain, offloaded, strict=True):
        assert torch.equal(a, b)


def test_split_is_by_leading_parameters_up_to_the_fraction():
    params = [torch.zeros(n) for n in (10, 30, 60)]
    assert offloaded_params(params, 0.1) == {id(params[0])}
    assert offloaded_params(params, 0.39) == {id(params[0])}
    assert offloaded_params(params, 0.4) == {id(params[0]), id(params[1])}
    assert offloaded_params(params, 1.0) == {id(p) for p in params} and not offloaded_params(params, 0.05)


def test_fp32_offload_equals_fp32_plain():
    plain, grads = _problem(torch.float32)
    offloaded, _ = _problem(torch.float32)
    _run(plain, grads, StateDtypes())
    _run(offloaded, grads, StateDtypes(), offload=1.0)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded, strict=True))


def test_offloaded_run_resumes_bit_identically(data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    flags = {**PRECISION_AWARE, "optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}
    resume_is_bit_identical(data, tmp_path, monkeypatch, **flags)
