"""The precision-aware AdamW (issue 42): its step equals an AdamW written here (fp32 math, each stored tensor rounded
to its dtype after every update) over 5 steps; all-fp32 it is torch's AdamW bit for bit; a training run with bf16
main grads and bf16 moments saves the moments in bf16 and resumes bit-identically; the spec refuses what it cannot
run, naming the field."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

sys.path.insert(0, str(Path(__file__).parents[2]))
from engine.checkpoint.safe_pickle import SafeFileSystemReader  # noqa: E402
from engine.contract.runfiles import RunDir  # noqa: E402
from engine.contract.spec import first_error, parse_spec  # noqa: E402
from engine.train import (
    entry,  # noqa: E402
    job,  # noqa: E402
)
from engine.train.precision_optimizer import PrecisionAwareAdamW, StateDtypes  # noqa: E402
from train_support import metric_rows, tiny_spec, write_instruction_data  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def _problem(param_dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Three parameters (a matrix, a 1-D one and a larger matrix) and 5 steps of gradients in their dtype."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (33, 17)]
    params = [torch.randn(s, generator=gen).to(param_dtype) for s in shapes]
    grads = [[(torch.randn(s, generator=gen) * 0.1).to(param_dtype) for s in shapes] for _ in range(5)]
    return params, grads


def _reference(params: list[torch.Tensor], grads: list[list[torch.Tensor]], dtypes: StateDtypes, wd: list[float]):
    """AdamW in fp32, master, m and v rounded to their dtypes after each update; the weights = master rounded."""
    master = [p.to(dtypes.main_param) for p in params]
    m = [torch.zeros(p.shape, dtype=dtypes.exp_avg) for p in params]
    v = [torch.zeros(p.shape, dtype=dtypes.exp_avg_sq) for p in params]
    for step, step_grads in enumerate(grads, start=1):
        for i, grad in enumerate(step_grads):
            g, p32 = grad.float(), master[i].float() * (1 - LR * wd[i])
            m32 = m[i].float() + (g - m[i].float()) * (1 - BETAS[0])
            v32 = v[i].float() * BETAS[1] + (1 - BETAS[1]) * g * g
            m_hat = m32 / (1 - BETAS[0] ** step)
            v_hat_sqrt = v32.sqrt() / (1 - BETAS[1] ** step) ** 0.5
            p32 = p32 - LR * m_hat / (v_hat_sqrt + EPS)
            master[i], m[i], v[i] = p32.to(dtypes.main_param), m32.to(dtypes.exp_avg), v32.to(dtypes.exp_avg_sq)
    return [x.to(params[0].dtype) for x in master], master, m, v


def _run(params, grads, dtypes: StateDtypes, offload: float = 0.0) -> PrecisionAwareAdamW:
    groups = [{"params": [params[0], params[2]], "weight_decay": WD}, {"params": [params[1]], "weight_decay": 0.0}]
    opt = PrecisionAwareAdamW(groups, lr=LR, betas=BETAS, eps=EPS, dtypes=dtypes, offload_fraction=offload)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return opt


CASES = {
    "bf16 moments": (torch.float32, StateDtypes(torch.float32, torch.bfloat16, torch.bfloat16)),
    "fp16 m, bf16 v": (torch.float32, StateDtypes(torch.float32, torch.float16, torch.bfloat16)),
    "bf16 weights, fp32 master": (torch.bfloat16, StateDtypes(torch.float32, torch.bfloat16, torch.bfloat16)),
    "bf16 weights, fp16 master": (torch.bfloat16, StateDtypes(torch.float16, torch.float32, torch.bfloat16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_step_equals_reference_over_five_steps(case: str):
    param_dtype, dtypes = CASES[case]
    params, grads = _problem(param_dtype)
    weights, master, m, v = _reference([p.clone() for p in params], grads, dtypes, [WD, 0.0, WD])
    opt = _run(params, grads, dtypes)
    for i, p in enumerate(params):
        state = opt.state[p]
        assert state["exp_avg"].dtype == dtypes.exp_avg and state["exp_avg_sq"].dtype == dtypes.exp_avg_sq
        torch.testing.assert_close(p.float(), weights[i].float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(state["exp_avg"].float(), m[i].float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(state["exp_avg_sq"].float(), v[i].float(), atol=1e-6, rtol=0)
        if param_dtype != dtypes.main_param:  # the master is the optimizer's own copy, in its dtype
            assert state["main_param"].dtype == dtypes.main_param
            torch.testing.assert_close(state["main_param"].float(), master[i].float(), atol=1e-6, rtol=0)
        else:
            assert "main_param" not in state
    # the bf16 moments really were rounded: fp32 moments give other weights
    if dtypes.exp_avg_sq != torch.float32 and param_dtype == torch.float32:
        plain, _ = _problem(param_dtype)
        _run(plain, grads, StateDtypes())
        assert not all(torch.equal(a, b) for a, b in zip(plain, params, strict=True))


def test_all_fp32_is_torch_adamw_bit_for_bit():
    params, grads = _problem(torch.float32)
    torch_params = [p.clone() for p in params]
    _run(params, grads, StateDtypes())
    groups = [{"params": [torch_params[0], torch_params[2]], "weight_decay": WD}, {"params": [torch_params[1]]}]
    ref = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, foreach=False)
    for step_grads in grads:
        for p, g in zip(torch_params, step_grads, strict=True):
            p.grad = g.clone()
        ref.step()
    for a, b in zip(params, torch_params, strict=True):
        assert torch.equal(a, b)


def test_state_dict_round_trip_keeps_dtypes_and_master():
    """torch's load casts every state tensor to the parameter's dtype; the fp32 master of a bf16 weight must not be."""
    params, grads = _problem(torch.bfloat16)
    dtypes = StateDtypes(torch.float32, torch.bfloat16, torch.float32)
    opt = _run(params, grads[:3], dtypes)
    saved = copy.deepcopy(opt.state_dict())  # as read from a checkpoint: no tensor shared with opt
    again = [p.clone() for p in params]
    fresh = PrecisionAwareAdamW(
        [{"params": [again[0], again[2]], "weight_decay": WD}, {"params": [again[1]], "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        dtypes=dtypes,
    )
    fresh.load_state_dict(saved)
    for p, q in zip(params, again, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "main_param"):
            assert fresh.state[q][key].dtype == opt.state[p][key].dtype
            assert torch.equal(fresh.state[q][key], opt.state[p][key])
    for step_grads in grads[3:]:
        for p, q, g in zip(params, again, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        fresh.step()
    assert all(torch.equal(p, q) for p, q in zip(params, again, strict=True))


def test_grad_norm_of_bf16_grads_is_fp32():
    """Megatron's get_grad_norm_fp32: fp32 accumulation and result from bf16 main grads (torch's would be bf16)."""
    from engine.train.optim import total_grad_norm

    params, grads = _problem(torch.bfloat16)
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g * 37
    norm = total_grad_norm(params)
    exact = float(torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in params])))
    assert norm.dtype == torch.float32 and float(norm) == pytest.approx(exact, rel=1e-6)
    bf16 = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert bf16.dtype == torch.bfloat16 and abs(float(bf16) - exact) > 100 * abs(float(norm) - exact)


# ------------------------------------------------------------------ a training run


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_instruction_data(tmp_path_factory.mktemp("data") / "sft")


PRECISION_AWARE = {
    "bf16": True,
    "use_precision_aware_optimizer": True,
    "main_grads_dtype": "bf16",
    "exp_avg_dtype": "bf16",
    "exp_avg_sq_dtype": "bf16",
}


def _final_weights(save: Path) -> dict[str, torch.Tensor]:
    state = torch.load(save / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    return state["model"]


def resume_is_bit_identical(data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **flags: object) -> None:
    """A 4-step run vs the same run crashed after its iteration-2 checkpoint and re-queued: equal losses, grad norms
    and final weights, bit for bit (``tests/unit/engine/train/test_train_job.py``'s crash, with exact equality)."""
    spec = tiny_spec(data, train_iters=4, save_interval=2, lr=1e-3, **flags)
    entry.run(parse_spec({**spec, "save": str(tmp_path / "a")}), RunDir(tmp_path / "run_a"))
    original = job.Trainer._save

    def save_then_crash(self: job.Trainer, iteration: int) -> None:
        original(self, iteration)
        if iteration == 2:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(job.Trainer, "_save", save_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        entry.run(parse_spec({**spec, "save": str(tmp_path / "b")}), RunDir(tmp_path / "run_b"))
    monkeypatch.setattr(job.Trainer, "_save", original)
    entry.run(parse_spec({**spec, "save": str(tmp_path / "b")}), RunDir(tmp_path / "run_b2"))
    straight, after = metric_rows(tmp_path / "run_a"), metric_rows(tmp_path / "run_b2")
    assert [r["iteration"] for r in after] == [3, 4]
    for a, b in zip(straight[2:], after, strict=True):
        assert (a["lm_loss"], a["grad_norm"]) == (b["lm_loss"], b["grad_norm"])
    first, second = _final_weights(tmp_path / "a"), _final_weights(tmp_path / "b")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_bf16_grads_and_moments_resume_bit_identically(data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    resume_is_bit_identical(data, tmp_path, monkeypatch, **PRECISION_AWARE)
    ckpt = tmp_path / "b" / "train_state" / "iter_0000002"
    metadata = SafeFileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    saved = {k: v.properties.dtype for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
    by_kind: dict[str, set[torch.dtype]] = {}
    for key, dtype in saved.items():
        kind = "model" if key.startswith("model.") else key.rsplit(".", 1)[-1]
        by_kind.setdefault(kind, set()).add(dtype)
    assert by_kind["exp_avg"] == by_kind["exp_avg_sq"] == {torch.bfloat16} and by_kind["main_param"] == {torch.float32}
    assert by_kind["model"] == {torch.bfloat16}  # the trainable weights (and their grads) are bf16


# ------------------------------------------------------------------ submission


def _refusal(**fields: object) -> str:
    spec = {"kind": "train", "data_path": ["x"], "train_iters": 1, "lr": 0.0, **fields}
    with pytest.raises(ValidationError) as err:
        parse_spec(spec)
    return first_error(err.value, "spec")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"exp_avg_dtype": "bf16"}, "spec.exp_avg_dtype: bf16 needs use_precision_aware_optimizer"),
        ({"main_grads_dtype": "bf16", "bf16": True}, "spec.main_grads_dtype: bf16 needs use_precision_aware"),
        ({"use_precision_aware_optimizer": True, "exp_avg_sq_dtype": "fp8"}, "spec.exp_avg_sq_dtype: fp8 needs"),
        ({"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"}, "spec.main_grads_dtype: bf16 main"),
        ({"use_precision_aware_optimizer": True, "main_params_dtype": "bf16"}, "spec.main_params_dtype: fp32 or fp16"),
        ({"use_precision_aware_optimizer": True, "main_params_dtype": "fp16"}, "spec.main_params_dtype: fp16 master"),
        ({"optimizer_cpu_offload": True}, "spec.optimizer_cpu_offload: needs use_precision_aware_optimizer"),
        ({"optimizer_offload_fraction": 0.5}, "spec.optimizer_offload_fraction: applies with"),
        ({"reuse_fp32_param": True}, "spec.reuse_fp32_param: not supported"),
        ({"swap_optimizer": True}, "spec.swap_optimizer: not supported"),
    ],
)
def test_refused_at_submission_naming_the_field(fields: dict[str, object], named: str):
    assert _refusal(**fields).startswith(named)


def test_megatron_flags_parse():
    from engine.contract.flags import spec_from_argv

    argv = ["--spec", "x", "--data-path", "d", "--train-iters", "1", "--lr", "0", "--bf16"]
    argv += ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16"]
    argv += ["--exp-avg-sq-dtype", "bf16", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]
    spec, _, _ = spec_from_argv("train", argv)
    assert spec.use_precision_aware_optimizer and spec.optimizer_offload_fraction == 0.5  # type: ignore[attr-defined]
    assert (spec.main_grads_dtype, spec.exp_avg_dtype, spec.exp_avg_sq_dtype) == ("bf16",) * 3  # type: ignore[attr-defined]
