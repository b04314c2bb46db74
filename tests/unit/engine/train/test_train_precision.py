"""Precision per mode (engine.parallel.precision): fp32 main weights, grads and Adam states, compute in bf16/fp16, a
LoRA base stored once in the compute dtype; bf16 losses within the bf16 tolerance of fp32; the tiny fp32 job's
losses unchanged by the step-runner and precision rewrite (values recorded before it, at b0de4d1)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parents[3]))
from engine.contract.model_config import preset  # noqa: E402
from engine.contract.runfiles import RunDir  # noqa: E402
from engine.contract.spec import TrainSpec, parse_spec  # noqa: E402
from engine.model.lora import apply_lora  # noqa: E402
from engine.model.qwen3 import Qwen3Model  # noqa: E402
from engine.parallel.device import Device  # noqa: E402
from engine.parallel.mesh import ParallelDims, build_mesh  # noqa: E402
from engine.parallel.parallelize import parallelize  # noqa: E402
from engine.parallel.precision import param_dtypes  # noqa: E402
from engine.train import entry  # noqa: E402
from engine.train.batches import MicroBatch, Sample, pad  # noqa: E402
from engine.train.loop import TrainState, train_step  # noqa: E402
from engine.train.optim import LossScaler, build_optimizer  # noqa: E402
from engine.train.schedule import Scheduler, schedule_from_spec  # noqa: E402
from engine.train.step_runner import Losses, ModuleRunner, lm_loss  # noqa: E402
from train_support import metric_rows, tiny_spec, write_instruction_data  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
MODES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"bf16": True},
    "fp16": {"fp16": True},
    "lora_fp32": {"lora_r": 4},
    "lora_bf16": {"bf16": True, "lora_r": 4},
}
SEQ, VOCAB = 24, 256


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_spec(**flags: Any) -> TrainSpec:
    return TrainSpec.model_validate(
        {
            "kind": "train",
            "data_path": ["unused"],
            "train_iters": 10,
            "lr": 1e-3,
            "lr_decay_style": "constant",
            "seq_length": SEQ,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            **({"lora_alpha": 8} if "lora_r" in flags else {}),  # alpha without a rank is refused
            **flags,
        }
    )


def build(spec: TrainSpec) -> ModuleRunner:
    """The trainer's path on one rank: model, LoRA, ``parallelize`` (precision + FSDP policy), runner."""
    model = Qwen3Model(preset("qwen3-tiny").replace(vocab_size=VOCAB, num_layers=2))
    model.init_weights(0)
    if spec.lora_r is not None:
        apply_lora(model, spec.lora_r, spec.lora_alpha, seed=1)
    mesh = build_mesh(Device("cpu"), ParallelDims(dp=1, pp=1, tp=1))
    parallelize(model, mesh, spec)
    return ModuleRunner(model, torch.device("cpu"), mesh["dp"].get_group(), lm_loss(False, chunk_size=16))


def batches(step: int) -> list[MicroBatch]:
    rng = np.random.default_rng(step)
    samples = []
    for i in range(4):
        ids = rng.integers(1, VOCAB, SEQ - i)
        labels = ids.copy()
        labels[: 3 + i] = -100
        samples.append(Sample(ids, labels))
    return [pad(samples[m : m + 2], SEQ, to_longest=False) for m in (0, 2)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def test_policy_table() -> None:
    got = {name: param_dtypes(make_spec(**flags)) for name, flags in MODES.items()}
    assert [(d.compute, d.trainable, d.frozen, d.reduce, d.base) for d in got.values()] == [
        (FP32, FP32, FP32, FP32, FP32),
        (BF16, FP32, BF16, FP32, FP32),
        (FP16, FP32, FP16, FP32, FP32),
        (FP32, FP32, FP32, FP32, FP32),
        (BF16, FP32, BF16, FP32, BF16),
    ]


# fp16 is left out: it takes bf16's path with another compute dtype (compute_dtype, proven by test_policy_table);
# fp32 covers the uncast path, bf16 the cast of a full model, lora_fp32 / lora_bf16 a frozen base uncast / cast.
@pytest.mark.parametrize("mode", [m for m in MODES if m != "fp16"])
def test_storage_compute_grad_and_adam_dtypes(mode: str, one_rank_group: None) -> None:
    spec = make_spec(**MODES[mode])
    want = param_dtypes(spec)
    runner = build(spec)
    seen: set[torch.dtype] = set()
    loss_fn = runner.loss_fn

    def recording(model: torch.nn.Module, mb: MicroBatch) -> Losses:
        out = loss_fn(model, mb)
        seen.add(model.output_weight().dtype)  # the head as the loss multiplied with it
        return out

    runner.loss_fn = recording
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: seen.add(mod.weight.dtype))
        for m in runner.module.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    runner.forward_backward(batches(0), torch.tensor(40.0), 1.0)
    for h in hooks:
        h.remove()
    assert seen == {want.compute}
    params = dict(runner.module.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    frozen = {n: p for n, p in params.items() if not p.requires_grad}
    assert bool(frozen) == mode.startswith("lora")
    assert {_local(p).dtype for p in trainable.values()} == {FP32}  # main weights
    assert {_local(p).dtype for p in frozen.values()} <= {want.frozen}
    assert {_local(p.grad).dtype for p in trainable.values()} == {FP32}  # accumulated in fp32
    assert all(p.grad is None for p in frozen.values())
    optimizer = build_optimizer(runner.module, spec)
    optimizer.step()
    states = [s for p in trainable.values() for s in optimizer.state[p].values() if s.ndim > 0]
    assert len(states) == 2 * len(trainable) and {_local(s).dtype for s in states} == {FP32}


def test_lora_bf16_base_is_stored_once_in_bf16(one_rank_group: None) -> None:
    def frozen_bytes(spec: TrainSpec) -> tuple[int, int, int]:
        params = list(build(spec).module.parameters())
        frozen = [_local(p) for p in params if not p.requires_grad]
        fp32 = sum(_local(p).numel() for p in params if _local(p).dtype == FP32)
        return sum(t.numel() for t in frozen), sum(t.untyped_storage().nbytes() for t in frozen), fp32

    numel, nbytes, fp32 = frozen_bytes(make_spec(**MODES["lora_bf16"]))
    assert nbytes == 2 * numel  # one bf16 copy, and its storage is the parameter's own (no fp32 behind it)
    adapters = sum(
        p.numel() for n, p in build(make_spec(**MODES["lora_bf16"])).module.named_parameters() if ".lora_" in n
    )
    assert fp32 == adapters  # the only fp32 tensors are the trainable adapters
    numel32, nbytes32, _ = frozen_bytes(make_spec(**MODES["lora_fp32"]))
    assert numel32 == numel and nbytes32 == 4 * numel


def test_lora_bf16_base_is_not_sharded_on_one_dp_rank(one_rank_group: None) -> None:
    """One DP rank: FSDP leaves the frozen base alone (it would keep an unsharded all-gather copy of it next to the
    parameter) and manages the adapters only."""
    module = build(make_spec(**MODES["lora_bf16"])).module
    params = dict(module.named_parameters())
    assert not [n for n, p in params.items() if not p.requires_grad and isinstance(p, DTensor)]
    assert all(isinstance(p, DTensor) for n, p in params.items() if ".lora_" in n)


def _losses(spec: TrainSpec, steps: int = 3) -> list[tuple[float, float]]:
    runner = build(spec)
    optimizer = build_optimizer(runner.module, spec)
    scheduler, scaler, state = Scheduler(optimizer, schedule_from_spec(spec)), LossScaler(spec), TrainState()
    out = []
    for step in range(steps):
        rec = train_step(runner, optimizer, scheduler, scaler, batches(step), state, global_batch_size=4, clip_grad=1.0)
        out.append((float(rec.loss_sum / rec.counts[0]), float(rec.grad_norm)))
    return out


@pytest.mark.parametrize("lora", [False, True])
def test_bf16_run_within_bf16_tolerance_of_fp32(lora: bool, one_rank_group: None) -> None:
    """The tolerance of the seed's bf16 layout tests (test_parallel_seed_scripts.py): loss 2e-3, grad norm 2e-2."""
    extra = {"lora_r": 4} if lora else {}
    full, low = _losses(make_spec(**extra)), _losses(make_spec(bf16=True, **extra))
    assert full[-1][0] < full[0][0] or lora  # it trains
    for (loss, norm), (ref_loss, ref_norm) in zip(low, full):
        assert loss == pytest.approx(ref_loss, rel=2e-3)
        assert norm == pytest.approx(ref_norm, rel=2e-2)
        assert loss != ref_loss  # bf16 compute really happened


# (lm loss, grad norm) per iteration of tiny_spec(train_iters=4) trained by the job, recorded at b0de4d1 (before the
# step runner and the precision policy); lora_bf16 is bit-identical too: its base was fp32 then cast to bf16 for
# every forward, it is now stored in bf16.
BEFORE = {
    "fp32": [
        (5.277323628519918, 4.568602561950684),
        (5.3478424514549365, 4.981366157531738),
        (4.826937993367513, 5.674468994140625),
        (4.488870431711008, 4.915365695953369),
    ],
    "lora_bf16": [
        (5.277130126953125, 0.5132442712783813),
        (5.347420512766078, 0.974142849445343),
        (5.212849299112956, 0.34937477111816406),
        (5.255282015413852, 0.42900925874710083),
    ],
}

# fp32 is the same on every x86 CPU seen; bf16 matmuls are not: CPUs with AVX-512-BF16 run native bf16 kernels whose
# accumulation order differs from the AVX2 emulation these values were recorded with (measured: 2e-5 relative on
# iteration 2's loss), so bf16 is held to a tolerance that still catches a changed computation (a wrong cast or
# scale moves the loss by > 1e-3).
TOLERANCE = {"fp32": (1e-6, 1e-5), "lora_bf16": (2e-4, 2e-3)}


def test_tiny_job_losses_unchanged(tmp_path: Path) -> None:
    data = write_instruction_data(tmp_path / "d" / "sft")
    for name, flags in {"fp32": {}, "lora_bf16": {"bf16": True, "lora_r": 4, "lora_alpha": 8}}.items():
        spec = parse_spec(tiny_spec(data, train_iters=4, **flags))  # no save: a checkpoint moves no loss
        entry.run(spec, RunDir(tmp_path / name / "run"))
        rows = metric_rows(tmp_path / name / "run")
        loss_rel, norm_rel = TOLERANCE[name]
        for row, (loss, norm) in zip(rows, BEFORE[name], strict=True):
            assert row["lm_loss"] == pytest.approx(loss, rel=loss_rel), (name, row["iteration"])
            assert row["grad_norm"] == pytest.approx(norm, rel=norm_rel), (name, row["iteration"])
