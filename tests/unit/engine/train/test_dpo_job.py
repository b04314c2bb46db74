"""Stage dpo as a job, in one process: three fp32 steps equal TRL's ``DPOTrainer`` on the same pairs and weights
(loss, grad norm, rewards), for sigmoid DPO, IPO and the reference-free SimPO; LoRA DPO trains against its base with the
adapters off; a resumed run keeps the reference of the run's start."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[3]))
from dpo_support import trl_matched_spec, trl_run, write_trl_pairs  # noqa: E402
from engine.contract.runfiles import RunDir  # noqa: E402
from engine.contract.spec import parse_spec  # noqa: E402
from engine.train import (
    entry,  # noqa: E402
    job,  # noqa: E402
)
from train_support import metric_rows, tiny_spec, write_pairwise_data  # noqa: E402

PAIRS = {
    "prompt": ["hello there", "what is 2+2", "name a colour"],
    "chosen": [" hi friend, how are you", " 4", " blue"],
    "rejected": [" go away", " 5 or maybe 6", " a fish that swims"],
}
STEPS, LR = 3, 1e-3


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = Qwen3Config(vocab_size=151936, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, **shape)
    model = Qwen3ForCausalLM(config)
    out = tmp_path_factory.mktemp("hf") / "tiny"
    model.save_pretrained(out)
    return model, out


def _ours(data: str, load: Path, tmp_path: Path, **extra: Any) -> list[dict[str, Any]]:
    spec = trl_matched_spec(data, str(load), STEPS, LR, len(PAIRS["chosen"]), 64, **extra)
    entry.run(parse_spec(spec), RunDir(tmp_path / "run"))
    return metric_rows(tmp_path / "run")


def _assert_equal(ours: list[dict[str, Any]], theirs: list[dict[str, float]], simpo: bool) -> None:
    """Every step's loss, grad norm, rewards and log-probs equal TRL's (and its logits/*, but for SimPO)."""
    assert len(ours) == len(theirs) == STEPS
    for a, b in zip(ours, theirs, strict=True):
        assert a["lm_loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["rewards/accuracies"] == pytest.approx(b["rewards/accuracies"])
        assert a["rewards/margins"] == pytest.approx(b["rewards/margins"], rel=1e-4, abs=1e-6)
        # logits/*: DPOTrainer's mean over labelled positions and the vocabulary; TRL's CPOTrainer (SimPO here)
        # averages over every position, prompt and padding included, which ours does not copy
        same = ("logps/chosen", "logps/rejected") + (() if simpo else ("logits/chosen", "logits/rejected"))
        for name in same:
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name


def test_sigmoid_dpo_with_another_ref_model_equals_trl(
    hf_model: tuple[Any, Path], qwen_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Sigmoid DPO (the default loss) with ref_model: the reference read from its own checkpoint (here a perturbed
    copy of load), not from load; the reference from load is the other losses' case below."""
    model, load = hf_model
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    ref.save_pretrained(tmp_path / "ref")
    theirs, batch = trl_run(
        model, qwen_tokenizer_dir, tmp_path, PAIRS, STEPS, LR, ref=ref, loss_type=["sigmoid"], beta=0.1
    )
    ours = _ours(
        write_trl_pairs(batch, tmp_path / "pairs"), load, tmp_path, ref_model=str(tmp_path / "ref"),
        dpo_loss_type="sigmoid", dpo_beta=0.1,
    )  # fmt: skip
    assert abs(ours[0]["rewards/margins"]) > 1e-3  # the reference differs from the policy at step 1
    _assert_equal(ours, theirs, simpo=False)


@pytest.mark.parametrize(
    ("trl_args", "ours_args"),
    [
        ({"loss_type": ["ipo"], "beta": 0.5}, {"dpo_loss_type": "ipo", "dpo_beta": 0.5}),
        (
            {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5},
            {"dpo_loss_type": "simpo", "dpo_beta": 2.0, "simpo_gamma": 0.5},
        ),
    ],
    ids=["ipo", "simpo"],
)
def test_dpo_job_equals_trl_over_three_steps(
    hf_model: tuple[Any, Path], qwen_tokenizer_dir: Path, tmp_path: Path, trl_args: dict, ours_args: dict
) -> None:
    model, load = hf_model
    theirs, batch = trl_run(model, qwen_tokenizer_dir, tmp_path, PAIRS, STEPS, LR, **trl_args)
    ours = _ours(write_trl_pairs(batch, tmp_path / "pairs"), load, tmp_path, **ours_args)
    _assert_equal(ours, theirs, simpo="simpo_gamma" in ours_args)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_pairwise_data(tmp_path_factory.mktemp("pairs") / "pairs")


def _tiny_dpo(data: str, **extra: Any) -> dict[str, Any]:
    base = tiny_spec(data, stage="dpo", is_pairwise_dataset=True, global_batch_size=4, lr_warmup_iters=0)
    return {**base, **extra}


def test_adapters_disabled_run_the_base_exactly() -> None:
    from engine.contract.model_config import ModelConfig
    from engine.model.lora import adapters_disabled, apply_lora
    from engine.model.qwen3 import Qwen3Model

    cfg = ModelConfig(2, 32, 64, 4, 2, 8, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    base = Qwen3Model(cfg)
    base.init_weights(1)
    lora = copy.deepcopy(base)
    apply_lora(lora, 4, 8.0, 0.0, ["linear_qkv", "linear_fc1"])
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if ".lora_B." in name:
                p.normal_()  # a trained adapter: B no longer zero
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad(), adapters_disabled(lora):
        off = lora(ids, return_hidden=True)
    assert torch.equal(off, base(ids, return_hidden=True).detach())
    assert not torch.allclose(lora(ids, return_hidden=True), off)  # back on after the block


def test_lora_dpo_trains_against_the_base(pairs: str, tmp_path: Path) -> None:
    spec = _tiny_dpo(pairs, train_iters=4, lora_r=4, lora_alpha=8, lora_target_modules=["linear_qkv", "linear_fc1"])
    entry.run(parse_spec(spec), RunDir(tmp_path / "run"))
    rows = metric_rows(tmp_path / "run")
    # B = 0 at the start: the policy is its base, so step 1 is ln 2 with zero rewards, whatever the base
    assert rows[0]["lm_loss"] == pytest.approx(np.log(2), rel=1e-6) and rows[0]["rewards/margins"] == 0
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] and rows[-1]["rewards/margins"] > 0


def test_resumed_dpo_keeps_the_initial_reference(pairs: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # one step after the resume shows which reference it took (a step's loss and margins are the reference's)
    spec = _tiny_dpo(pairs, train_iters=2, save_interval=1)
    entry.run(parse_spec({**spec, "save": str(tmp_path / "a")}), RunDir(tmp_path / "run_a"))
    straight = metric_rows(tmp_path / "run_a")
    original = job.Trainer._save

    def save_then_crash(self: job.Trainer, iteration: int) -> None:
        original(self, iteration)
        if iteration == 1:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(job.Trainer, "_save", save_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        entry.run(parse_spec({**spec, "save": str(tmp_path / "b")}), RunDir(tmp_path / "run_b"))
    monkeypatch.setattr(job.Trainer, "_save", original)
    entry.run(parse_spec({**spec, "save": str(tmp_path / "b")}), RunDir(tmp_path / "run_b2"))
    after = metric_rows(tmp_path / "run_b2")
    assert [r["iteration"] for r in after] == [2]
    assert straight[1]["rewards/margins"] != 0  # the policy has left the reference
    for a, b in zip(straight[1:], after, strict=True):  # a reference taken from the resumed weights would differ
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-6)
        assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def _exact(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row's figures that must repeat exactly (not timings or memory)."""
    return {k: row[k] for k in ("lm_loss", "grad_norm", "rewards/margins", "rewards/chosen", "logps/rejected")}


def test_precomputed_reference_equals_the_online_one_and_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """precompute_ref_log_probs: with one pair per micro-batch the stored log-probs are the online reference's bit for
    bit, so every step is identical; the table lands beside the dataset with a note of its key, and a second run
    with the same dataset, reference and numerics reads it instead of computing it (and so does a resumed one)."""
    from engine.train import reference_logps

    data = write_pairwise_data(tmp_path / "data" / "pairs")
    spec = _tiny_dpo(data, train_iters=2, micro_batch_size=1)  # the second step reads other pairs' rows
    entry.run(parse_spec(spec), RunDir(tmp_path / "online"))
    online = metric_rows(tmp_path / "online")
    _, summary = entry.run(parse_spec({**spec, "precompute_ref_log_probs": True}), RunDir(tmp_path / "stored"))
    stored = metric_rows(tmp_path / "stored")
    assert [_exact(r) for r in online] == [_exact(r) for r in stored]
    (where,) = summary["reference_logps"].values()
    table = Path(where["stored"])
    assert table.parent == Path(data + "_ref_logps") and table.with_suffix(".json").is_file()
    assert np.load(table, allow_pickle=False).shape == (16, 2)

    def no_second_pass(*args: Any) -> None:
        raise AssertionError("the stored table should have been read")

    monkeypatch.setattr(reference_logps, "_compute", no_second_pass)
    _, again = entry.run(parse_spec({**spec, "precompute_ref_log_probs": True}), RunDir(tmp_path / "again"))
    assert next(iter(again["reference_logps"].values()))["reused"] == str(table)
    assert [_exact(r) for r in metric_rows(tmp_path / "again")] == [_exact(r) for r in stored]
    # another reference (another seed draws other initial weights) is another key: computed, not reused
    with pytest.raises(AssertionError, match="stored table should have been read"):
        entry.run(parse_spec({**spec, "precompute_ref_log_probs": True, "seed": 8}), RunDir(tmp_path / "other"))


def test_validation_reports_trls_metrics_on_held_out_pairs(pairs: str, tmp_path: Path) -> None:
    """Held-out pairs get the training figures as val_*: the loss per pair, rewards and log-probs per pair."""
    spec = _tiny_dpo(pairs, train_iters=2, split="75,25,0", eval_iters=1, eval_interval=2)
    entry.run(parse_spec(spec), RunDir(tmp_path / "run"))
    val = [r for r in metric_rows(tmp_path / "run") if "val_lm_loss" in r]
    assert len(val) == 1 and val[0]["val_loss_tokens"] == 4  # 4 held-out pairs (one global batch)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert np.isfinite(val[0][f"val_{name}"]), name
    margins = val[0]["val_rewards/margins"]
    assert margins == pytest.approx(val[0]["val_rewards/chosen"] - val[0]["val_rewards/rejected"], rel=1e-5)
    assert 0.0 <= val[0]["val_rewards/accuracies"] <= 1.0
