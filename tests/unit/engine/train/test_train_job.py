"""The train runner in one process: falling loss, metrics, checkpoint layout, resume equal to an uninterrupted run,
LoRA from an HF checkpoint in bf16 with adapter-only save, and bad inputs refused before any work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from engine.checkpoint.hf import save_hf  # noqa: E402
from engine.cli import main  # noqa: E402
from engine.contract.model_config import ModelConfig  # noqa: E402
from engine.contract.runfiles import BadInput, RunDir  # noqa: E402
from engine.contract.spec import parse_spec  # noqa: E402
from engine.model.qwen3 import Qwen3Model  # noqa: E402
from engine.train import (
    entry,  # noqa: E402
    job,  # noqa: E402
)
from train_support import TINY_SHAPE, metric_rows, tiny_spec, write_instruction_data  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_instruction_data(tmp_path_factory.mktemp("data") / "sft")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = ModelConfig(2, 64, 128, 4, 2, 16, vocab_size=512, max_position_embeddings=256)
    model = Qwen3Model(cfg)
    model.init_weights(1)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    save_hf(model.state_dict(), cfg, out, dtype=torch.float32)
    return out


def _train(spec: dict, run_dir: Path):
    return entry.run(parse_spec(spec), RunDir(run_dir))


def test_resume_equals_uninterrupted_run(data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = tiny_spec(data, train_iters=4, save_interval=2)  # a checkpoint mid-run and one at the end
    outputs, summary = _train({**spec, "save": str(tmp_path / "a")}, tmp_path / "run_a")
    straight = metric_rows(tmp_path / "run_a")
    assert [r["iteration"] for r in straight] == [1, 2, 3, 4]
    assert straight[-1]["lm_loss"] < straight[0]["lm_loss"] - 0.5
    for key in (
        "lm_loss",
        "lr",
        "grad_norm",
        "loss_scale",
        "skipped_iterations",
        "nan_iterations",
        "consumed_samples",
        "iteration_time_ms",
        "tokens_per_s",
        "tflops",
        "mfu",
    ):
        assert key in straight[0]
    assert outputs["checkpoint"] == str(tmp_path / "a")
    assert (tmp_path / "a" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (tmp_path / "a" / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    assert summary["iterations"] == 4 and summary["nan_iterations"] == 0

    # The same job crashes right after its iteration-2 checkpoint, then is re-queued unchanged.
    original = job.Trainer._save

    def save_then_crash(self: job.Trainer, iteration: int) -> None:
        original(self, iteration)
        if iteration == 2:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(job.Trainer, "_save", save_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _train({**spec, "save": str(tmp_path / "b")}, tmp_path / "run_b")
    monkeypatch.setattr(job.Trainer, "_save", original)
    _, resumed = _train({**spec, "save": str(tmp_path / "b")}, tmp_path / "run_b2")
    assert resumed["resumed_from"].endswith("iter_0000002") and resumed["start_iteration"] == 2
    after = metric_rows(tmp_path / "run_b2")
    assert [r["iteration"] for r in after] == [3, 4]
    for a, b in zip(straight[2:], after, strict=True):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["lr"] == a["lr"] and b["consumed_samples"] == a["consumed_samples"]


def test_lora_bf16_from_hf_saves_adapters_only(data: str, hf_dir: Path, tmp_path: Path):
    shape = {k: v for k, v in TINY_SHAPE.items() if k not in ("ffn_hidden_size",)}  # flags may be partial
    spec = tiny_spec(
        data,
        **shape,
        load=str(hf_dir),
        finetune=True,
        bf16=True,
        lora_r=4,
        lora_alpha=8,
        lora_target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        lr=1e-2,
        train_iters=3,
        save=str(tmp_path / "save"),
        save_hf=True,
        tensorboard_dir=str(tmp_path / "tb"),
        recompute_granularity="full",
    )
    outputs, summary = _train(spec, tmp_path / "run")
    assert summary["load_format"] == "hf" and summary["lora"] is True
    state = torch.load(tmp_path / "save" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    keys = list(state["model"])
    assert keys and all(".lora_A.default." in k or ".lora_B.default." in k for k in keys)
    assert state["args"].lora_r == 4 and state["args"].lora_base == str(hf_dir)
    assert (Path(outputs["hf"]) / "model.safetensors.index.json").is_file()
    assert any((tmp_path / "tb").iterdir())
    rows = metric_rows(tmp_path / "run")
    assert rows[0]["loss_scale"] == 1.0 and all(r["grad_norm"] is not None for r in rows)


def test_checkpoint_shape_mismatch_is_bad_input_before_work(data: str, hf_dir: Path, tmp_path: Path):
    spec = parse_spec(tiny_spec(data, load=str(hf_dir), hidden_size=128))
    with pytest.raises(BadInput, match="hidden_size: the spec says 128 but the checkpoint"):
        job.plan_run(spec, RunDir(tmp_path / "run"))


def test_shape_taken_from_the_checkpoint_is_recorded(data: str, hf_dir: Path, tmp_path: Path):
    """The Spec tab's "from the checkpoint" values: one `config` event with the spec flags the checkpoint sets,
    rotary_base and norm_epsilon included (the schema's defaults would be wrong for a Qwen3 checkpoint)."""
    raw = {k: v for k, v in tiny_spec(data, load=str(hf_dir), finetune=True).items() if k not in TINY_SHAPE}
    job.plan_run(parse_spec({**raw, "num_layers": 2}), RunDir(tmp_path / "run"))
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    config = [e for e in events if e["type"] == "config"]
    assert len(config) == 1 and config[0]["data"]["source"] == "checkpoint" and config[0]["data"]["format"] == "hf"
    assert config[0]["data"]["values"] == {
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "num_attention_heads": 4,
        "kv_channels": 16,
        "padded_vocab_size": 512,
        "norm_epsilon": 1e-6,
        "rotary_base": 1e6,
        "untie_embeddings_and_output_weights": True,
        "group_query_attention": True,
        "num_query_groups": 2,
        "max_position_embeddings": 256,
    }


def test_global_batch_must_divide_by_micro_batch_times_dp(data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = parse_spec(tiny_spec(data, micro_batch_size=2, global_batch_size=6))
    monkeypatch.setenv("WORLD_SIZE", "2")  # the spec's resources say 1; torchrun says 2
    with pytest.raises(BadInput, match=r"global_batch_size: 6 is not divisible by micro_batch_size × DP \(2 × 2"):
        job.plan_run(spec, RunDir(tmp_path / "run"))


def test_missing_data_files_exit_2_with_message(tmp_path: Path):
    """Through the CLI's ``main`` in this process (``python -m engine`` only raises SystemExit with its code: that
    wrapper is started by train_support.run_train's one-process runs, e.g. test_train_dp)."""
    spec = tiny_spec(str(tmp_path / "nowhere" / "sft"))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert main(["train", "--spec", str(tmp_path / "spec.json"), "--run-dir", str(tmp_path / "run")]) == 2
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    error = events[-1]
    assert error["type"] == "error" and error["data"]["field"] == "data_path"
    assert "no indexed dataset for prefix" in error["message"] and "nowhere/sft" in error["message"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fp16_overflow_skips_iterations_then_trains(data: str, tmp_path: Path):
    # Too large a loss scale overflows the fp16 gradients: the iteration is skipped (no optimizer or LR step, counted
    # as skipped), the scale halves (hysteresis 1) and training proceeds; the logged scale is the one after the step.
    spec = tiny_spec(data, fp16=True, train_iters=2, hysteresis=1, initial_loss_scale=2.0**17)
    _, summary = _train(spec, tmp_path / "run")
    rows = metric_rows(tmp_path / "run")
    assert [r["skipped_iterations"] for r in rows] == [1, 0] and summary["skipped_iterations"] == 1
    assert rows[0]["grad_norm"] is None and rows[1]["grad_norm"] is not None
    assert [r["loss_scale"] for r in rows] == [2.0**16] * 2
    assert rows[0]["lr"] == 0.0 and rows[1]["lr"] == 1e-2  # the skipped iteration did not advance the warmup
    assert summary["nan_iterations"] == 0


def test_finetune_from_own_training_state_resets_iteration(data: str, tmp_path: Path):
    first = tiny_spec(data, train_iters=2, save_interval=2, save=str(tmp_path / "a"))
    _train(first, tmp_path / "run_a")
    second = tiny_spec(
        data, train_iters=2, load=str(tmp_path / "a" / "train_state"), finetune=True, save=str(tmp_path / "b")
    )
    _, summary = _train(second, tmp_path / "run_b")
    assert summary["load_format"] == "native" and summary["start_iteration"] == 0
    before, after = metric_rows(tmp_path / "run_a"), metric_rows(tmp_path / "run_b")
    assert after[0]["lm_loss"] < before[0]["lm_loss"]  # starts from the trained weights, not a fresh init


def test_yarn_set_in_the_spec_trains_and_exports_it(data: str, hf_dir: Path, tmp_path: Path):
    """A checkpoint without rope scaling fine-tuned with YaRN flags: the run uses them and the HF export carries
    them, so transformers reads the trained model with the same logits as ours, past the original positions."""
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    from engine.model import hf_mapping

    raw = {k: v for k, v in tiny_spec(data, load=str(hf_dir), finetune=True).items() if k not in TINY_SHAPE}
    yarn = {
        "rope_scaling_type": "yarn",
        "rope_scaling_factor": 2.0,
        "rope_scaling_original_max_position_embeddings": 256,
    }
    spec = {**raw, **yarn, "train_iters": 2, "save": str(tmp_path / "save"), "save_hf": True}
    outputs, _ = _train(spec, tmp_path / "run")
    export = Path(outputs["hf"])
    config = json.loads((export / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256}
    cfg = ModelConfig.from_hf(config)
    ours = Qwen3Model(cfg)
    tensors = {k: v for f in export.glob("*.safetensors") for k, v in load_file(f).items()}
    ours.load_state_dict(dict(hf_mapping.native_from_hf(tensors.__getitem__, cfg)), strict=True)
    ids = torch.randint(0, 512, (1, 400), generator=torch.Generator().manual_seed(0))  # past 256
    theirs = Qwen3ForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (theirs(ids).logits - ours.float().eval()(ids)).abs().max().item() <= 1e-4
