"""LR schedule (Megatron semantics, checked against the seed's logged values), optimizer groups, loss scaler."""

from __future__ import annotations

import types

import pytest
import torch

from engine.contract.model_config import preset
from engine.model.qwen3 import Qwen3Model
from engine.train.optim import LossScaler, param_groups
from engine.train.schedule import LRSchedule, Scheduler, schedule_from_spec


def _spec(**kw):
    base = dict(
        lr=1.25e-6,
        min_lr=1.25e-7,
        lr_decay_style="linear",
        lr_decay_iters=None,
        train_iters=390,
        lr_warmup_fraction=None,
        lr_warmup_iters=0,
        lr_warmup_init=0.0,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_seed_full_sft_lr_log_values():
    # tune_qwen3_4B_4K_full: no --lr-decay-style (linear), 390 iterations; the log prints the LR after the step.
    s = schedule_from_spec(_spec())
    assert f"{s.lr_at(1):.6E}" == "1.247115E-06"
    assert f"{s.lr_at(2):.6E}" == "1.244231E-06"
    assert f"{s.lr_at(10):.6E}" == "1.221154E-06"
    assert f"{s.lr_at(390):.6E}" == "1.250000E-07"


def test_seed_lora_lr_log_values():
    # tune_qwen3_4B_4K_lora: cosine, warmup fraction 0.1 of 800 iterations.
    s = schedule_from_spec(_spec(lr=1.25e-5, lr_decay_style="cosine", train_iters=800, lr_warmup_fraction=0.1))
    assert f"{s.lr_at(1):.6E}" == "1.562500E-07"
    assert f"{s.lr_at(2):.6E}" == "3.125000E-07"
    assert f"{s.lr_at(800):.6E}" == "1.250000E-07"
    assert s.lr_at(80) == pytest.approx(1.25e-5)


def test_constant_and_past_decay():
    assert LRSchedule(1.0, 0.1, "constant", 10, 2).lr_at(50) == 1.0
    assert LRSchedule(1.0, 0.1, "cosine", 10, 0).lr_at(11) == 0.1
    assert LRSchedule(1.0, 0.0, "inverse-square-root", 100, 4).lr_at(16) == pytest.approx(0.5)


def test_scheduler_sets_param_groups_and_restores():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = Scheduler(opt, LRSchedule(1.0, 0.0, "linear", 4, 0))
    assert opt.param_groups[0]["lr"] == 1.0
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.75
    other = Scheduler(torch.optim.AdamW([p], lr=1.0), LRSchedule(1.0, 0.0, "linear", 4, 0))
    other.load_state_dict(sched.state_dict())
    assert other.optimizer.param_groups[0]["lr"] == 0.75


def test_scheduler_is_lambda_lr_giving_lr_at_exactly_and_resumes_exactly():
    import json

    schedule = LRSchedule(3e-4, 3e-5, "cosine", 10, 2.5, 1e-6)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = Scheduler(opt, schedule)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    seen, saved = [sched.lr], None
    for step in range(1, 8):
        opt.step()
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
        if step == 3:
            saved = json.loads(json.dumps(sched.state_dict()))  # it travels in meta.json
    assert seen == [schedule.lr_at(s) for s in range(8)]  # bit-exact, no max_lr × ratio rounding
    for state in (saved, {"num_steps": 3, "schedule": {}}):  # also the format written before LambdaLR
        opt2 = torch.optim.AdamW([p], lr=1.0)
        resumed = Scheduler(opt2, schedule)
        resumed.load_state_dict(state)
        after = [opt2.param_groups[0]["lr"]]
        for _ in range(4):
            opt2.step()
            resumed.step()
            after.append(resumed.lr)
        assert after == seen[3:]


def test_no_weight_decay_on_norms():
    model = Qwen3Model(preset("qwen3-tiny"))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 2 * 4 + 1


def test_dynamic_loss_scaler_hysteresis_and_growth():
    spec = types.SimpleNamespace(
        fp16=True, loss_scale=None, initial_loss_scale=1024.0, min_loss_scale=1.0, loss_scale_window=3, hysteresis=2
    )
    scaler = LossScaler(spec)
    scaler.update(found_inf=True)
    assert scaler.scale == 1024.0  # first overflow is absorbed by hysteresis
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale == 1024.0
    bf16 = LossScaler(
        types.SimpleNamespace(
            fp16=False,
            loss_scale=None,
            initial_loss_scale=4096.0,
            min_loss_scale=1.0,
            loss_scale_window=3,
            hysteresis=2,
        )
    )
    bf16.update(found_inf=True)
    assert bf16.scale == 1.0  # the seed's bf16 runs log "loss scale: 1.0"
