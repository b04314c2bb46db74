"""A tiny Qwen3-MoE trains as a job in one process: full fine-tune from flags and LoRA (attention and experts) from
an HF Qwen3-MoE directory written by transformers; step 1's loss and load-balancing loss equal the model's own on
the same batches; the loss falls; router metrics are reported; the HF export loads back in transformers with equal
logits; TP and PP jobs equal one process; bad expert-parallel sizes name their field (EP runs:
test_train_expert_parallel)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from moe_support import write_hf_moe_dir  # noqa: E402

from engine.contract.model_config import ModelConfig  # noqa: E402
from engine.contract.runfiles import BadInput, RunDir  # noqa: E402
from engine.contract.spec import parse_spec  # noqa: E402
from engine.model.moe import router_metrics  # noqa: E402
from engine.model.qwen3 import Qwen3Model  # noqa: E402
from engine.train import (
    entry,  # noqa: E402
    job,  # noqa: E402
)
from engine.train.step_runner import micro_batch_loss  # noqa: E402
from train_support import TINY_SHAPE, metric_rows, tiny_spec, write_instruction_data  # noqa: E402

MOE_FLAGS = {
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
    "moe_layer_freq": [1, 0],
    "moe_aux_loss_coeff": 0.01,
    "norm_topk_prob": True,
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_instruction_data(tmp_path_factory.mktemp("data") / "sft", n=24)


def _train_capturing(spec: dict, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, list]:
    """Run the job; returns (outputs, step 1's micro-batches)."""
    first: list = []
    real = job.train_step

    def capture(runner, optimizer, scheduler, scaler, batches, state, **kw):  # noqa: ANN001, ANN202
        if not first:
            first.extend(batches)
        return real(runner, optimizer, scheduler, scaler, batches, state, **kw)

    monkeypatch.setattr(job, "train_step", capture)
    outputs, _ = entry.run(parse_spec(spec), RunDir(run_dir))
    return outputs, first


def _reference(model: Qwen3Model, batches: list) -> tuple[float, float]:
    """(lm loss, load_balancing_loss) of ``batches`` computed by the model directly."""
    model.train()
    with torch.no_grad():
        loss = sum(float(micro_batch_loss(model, mb, 1024)) for mb in batches)
    tokens = sum(mb.num_loss_tokens for mb in batches)
    metrics = router_metrics(model)
    assert metrics is not None
    return loss / tokens, float(metrics.summary()["load_balancing_loss"])


def test_moe_full_finetune_from_flags(data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = tiny_spec(data, **MOE_FLAGS, train_iters=6, save=str(tmp_path / "save"), save_hf=True)
    outputs, first = _train_capturing(spec, tmp_path / "run", monkeypatch)
    rows = metric_rows(tmp_path / "run")
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 0.3
    for row in rows:
        assert 1.0 <= row["load_balancing_loss"] < 4.0  # switch loss: 1 when balanced, E at worst
        assert row["expert_load_imbalance_max"] == row["expert_load_imbalance_layer_0"] >= 1.0
        assert "expert_load_imbalance_layer_1" not in row  # the dense layer
        assert row["dropped_token_fraction"] == 0.0
    cfg = job.plan_run(parse_spec(spec), RunDir(tmp_path / "plan")).cfg
    assert cfg.num_experts == 4 and cfg.moe_layer_freq == (1, 0) and cfg.moe_aux_loss_coeff == 0.01
    ref = Qwen3Model(cfg)
    ref.init_weights(spec["seed"])  # the full build the sharded seeded init reproduces
    loss, balance = _reference(ref, first)
    assert rows[0]["lm_loss"] == pytest.approx(loss, rel=1e-6)
    assert rows[0]["load_balancing_loss"] == pytest.approx(balance, rel=1e-6)
    # the final HF export loads in transformers with our logits
    from transformers import Qwen3MoeForCausalLM

    hf = Qwen3MoeForCausalLM.from_pretrained(outputs["hf"]).eval()
    from engine.checkpoint.hf import HFCheckpoint

    ours = Qwen3Model(cfg)
    ours.load_state_dict(HFCheckpoint(outputs["hf"]).native_state_dict())
    ids = torch.randint(0, 512, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.eval()(ids), rtol=1e-4, atol=1e-4)
    assert hf.config.num_experts_per_tok == 2 and hf.config.mlp_only_layers == [1]
    # the final mcore export reads back with the same shape and weights (what convert / eval load)
    from engine.load.weights import open_load

    mcore = open_load(outputs["checkpoint"])
    assert mcore.format == "mcore" and mcore.config == cfg
    # in MindSpeed's layout (SequentialMLP without --moe-grouped-gemm), the same writer as convert's
    stored = torch.load(Path(outputs["checkpoint_dir"]) / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert stored["model"]["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"].shape == (64, 32)
    assert "decoder.layers.0.mlp.router.weight" in stored["model"] and stored["args"].num_experts == 4
    state = ours.state_dict()
    assert all(torch.equal(mcore.source.get_native(k), state[k]) for k in state)  # type: ignore[union-attr]


def _hf_moe_dir(path: Path) -> Path:
    return write_hf_moe_dir(path)


def _drop_shape(spec: dict) -> dict:
    """The shape comes from the checkpoint."""
    for key in TINY_SHAPE:
        spec.pop(key, None)
    return spec


def test_moe_lora_from_hf_checkpoint(data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf_dir = _hf_moe_dir(tmp_path / "hf")
    spec = tiny_spec(
        data,
        load=str(hf_dir),
        finetune=True,
        lora_r=4,
        lora_alpha=8,
        lr=3e-2,
        train_iters=5,
        global_batch_size=4,
        save=str(tmp_path / "save"),
        save_hf=True,
        moe_aux_loss_coeff=0.01,
    )
    _drop_shape(spec)
    outputs, first = _train_capturing(spec, tmp_path / "run", monkeypatch)
    rows = metric_rows(tmp_path / "run")
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]
    assert {"expert_load_imbalance_layer_0", "expert_load_imbalance_layer_1"} <= rows[0].keys()
    # step 1 = the HF model's loss (LoRA B = 0), the balancing loss its router's
    plan = job.plan_run(parse_spec(spec), RunDir(tmp_path / "plan"))
    assert plan.loaded is not None and plan.loaded.format == "hf" and plan.cfg.moe_aux_loss_coeff == 0.01
    ref = Qwen3Model(plan.cfg)
    ref.load_state_dict(plan.loaded.source.native_state_dict())  # type: ignore[union-attr]
    loss, balance = _reference(ref, first)
    assert rows[0]["lm_loss"] == pytest.approx(loss, rel=1e-6)
    assert rows[0]["load_balancing_loss"] == pytest.approx(balance, rel=1e-6)
    # adapters on attention and on every expert (stacked), nothing else saved
    state = torch.load(tmp_path / "save" / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    keys = set(state["model"])
    assert "decoder.layers.0.mlp.experts.linear_fc1.lora_A.default.weight" in keys
    assert state["model"]["decoder.layers.1.mlp.experts.linear_fc2.lora_B.default.weight"].shape == (4, 32, 4)
    assert "decoder.layers.0.self_attention.linear_qkv.lora_A.default.weight" in keys
    assert all(".lora_" in k for k in keys)
    # the merged HF export loads in transformers and differs from the base (the adapters trained)
    from transformers import Qwen3MoeForCausalLM

    merged = Qwen3MoeForCausalLM.from_pretrained(outputs["hf"]).eval()
    base = Qwen3MoeForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, 512, (1, 10))
    with torch.no_grad():
        assert not torch.allclose(merged(ids).logits, base(ids).logits)


def _hf_tensors(path: str) -> dict[str, torch.Tensor]:
    from engine.checkpoint.hf import HFCheckpoint

    ckpt = HFCheckpoint(path)
    names = ckpt.keys()  # a checkpoint object, not a dict
    return {k: ckpt.get(k) for k in names}


@pytest.mark.slow
def test_moe_tensor_and_pipeline_parallel_jobs_equal_one_process(data: str, tmp_path: Path) -> None:
    """TP 2 (sequence parallel; experts cut per expert) and PP 2 (the MoE layer on stage 0, the dense one on
    stage 1) jobs = one process: loss, grad norm and router figures per step, and the final HF export (written from
    the mcore rank files each layout wrote). LoRA on attention and the experts under TP 2 likewise."""
    from train_support import run_train

    # every layout pads each sample to seq_length - 1: padding tokens are routed too (as in Megatron), so the
    # layouts must route the same ones (packed rows are widened to a bucket under PP, see the module docs of
    # engine.train.router_stats)
    base = tiny_spec(data, **MOE_FLAGS, train_iters=3, save_hf=True, padding_free=False)
    two = {"resources": {"nproc_per_node": 2}}
    lora = {"lora_r": 4, "lora_alpha": 8, "lr": 3e-2}
    runs = {
        "one": (base, 1),
        "tp2": ({**base, **two, "tensor_model_parallel_size": 2, "sequence_parallel": True}, 2),
        "pp2": ({**base, **two, "pipeline_model_parallel_size": 2}, 2),
        "lora_one": ({**base, **lora}, 1),
        "lora_tp2": ({**base, **lora, **two, "tensor_model_parallel_size": 2}, 2),
    }
    for name, (spec, nproc) in runs.items():
        run_train({**spec, "save": str(tmp_path / name / "save")}, tmp_path / name, nproc)
    keys = ("lm_loss", "grad_norm", "load_balancing_loss", "expert_load_imbalance_layer_0", "dropped_token_fraction")
    for name, ref in (("tp2", "one"), ("pp2", "one"), ("lora_tp2", "lora_one")):
        got, want = metric_rows(tmp_path / name), metric_rows(tmp_path / ref)
        assert len(got) == len(want) == 3
        for step, (a, b) in enumerate(zip(got, want)):
            for key in keys:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-12), f"{name} step {step}: {key}"
        # weights after 3 AdamW steps: fp32 summation-order differences in the gradients (1e-7) come out of Adam's
        # m / sqrt(v) at up to ~1e-6 on a weight of ~0.02 + lr-sized updates
        exported, expected = (_hf_tensors(str(tmp_path / n / "save" / "hf")) for n in (name, ref))
        assert exported.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(exported[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize(
    ("ep", "nproc", "experts", "says"),
    [(4, 2, 4, "must divide the data-parallel size 2"), (3, 6, 4, "does not divide the model's 4 experts")],
)
def test_bad_expert_parallel_size_refused_at_parse(data: str, ep: int, nproc: int, experts: int, says: str) -> None:
    flags = {**MOE_FLAGS, "num_experts": experts}
    spec = tiny_spec(data, **flags, expert_model_parallel_size=ep, global_batch_size=12, micro_batch_size=1)
    with pytest.raises(ValueError, match=f"expert_model_parallel_size: EP {ep} {says}"):
        parse_spec({**spec, "resources": {"nproc_per_node": nproc}})


def test_expert_parallel_refused_for_dense_model_and_checkpoint_expert_count(
    data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A from-scratch dense model is refused at parse (its flags say it is dense); a loaded checkpoint's expert
    count (4) is known only once the checkpoint is read."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    common = {"global_batch_size": 8, "micro_batch_size": 1, "resources": {"nproc_per_node": 8}}
    dense = tiny_spec(data, expert_model_parallel_size=2, **common)
    with pytest.raises(ValueError, match="expert_model_parallel_size: EP 2 needs an MoE model"):
        parse_spec(dense)
    loaded = _drop_shape(
        tiny_spec(data, load=str(_hf_moe_dir(tmp_path / "hf")), expert_model_parallel_size=8, **common)
    )
    with pytest.raises(BadInput, match="EP 8 does not divide the model's 4 experts") as err:
        job.plan_run(parse_spec(loaded), RunDir(tmp_path / "loaded"))
    assert err.value.field == "expert_model_parallel_size"


def test_moe_shape_flag_disagreeing_with_checkpoint(data: str, tmp_path: Path) -> None:
    hf_dir = _hf_moe_dir(tmp_path / "hf")
    spec = _drop_shape(tiny_spec(data, load=str(hf_dir), num_experts=8))
    with pytest.raises(BadInput, match="num_experts") as err:
        job.plan_run(parse_spec(spec), RunDir(tmp_path / "run"))
    assert err.value.field == "num_experts"
    assert ModelConfig.from_hf_dir(hf_dir).num_experts == 4


def test_moe_hf_mcore_hf_round_trip_is_exact(tmp_path: Path) -> None:
    """transformers' Qwen3-MoE files -> MindSpeed's mcore layout -> HF: every tensor back bit for bit, and
    transformers loads the result (experts are stored per expert, so mg -> hf computes rather than copies rows)."""
    from transformers import Qwen3MoeForCausalLM

    from engine.checkpoint.hf import HFCheckpoint, save_hf
    from engine.checkpoint.megatron_read import MegatronCheckpoint
    from engine.checkpoint.megatron_write import save_mcore

    src = _hf_moe_dir(tmp_path / "hf")
    ckpt = HFCheckpoint(src)
    save_mcore(ckpt, ckpt.config, tmp_path / "mg")
    mcore = MegatronCheckpoint(tmp_path / "mg")
    assert mcore.config == ckpt.config and not mcore.can_copy(torch.float32)
    save_hf(mcore, mcore.config, tmp_path / "back")
    back, original = HFCheckpoint(tmp_path / "back"), ckpt
    names = original.keys()  # a checkpoint object, not a dict
    assert set(back.keys()) == set(names)
    assert all(torch.equal(back.get(k), original.get(k)) for k in names)
    assert Qwen3MoeForCausalLM.from_pretrained(tmp_path / "back").config.num_experts == 4


@pytest.mark.slow
def test_moe_data_parallel_equals_one_process(data: str, tmp_path: Path) -> None:
    """DP 2 (FSDP shards the stacked experts on dim 0; router figures summed over DP) = one process, step for step."""
    from train_support import run_train, train_in_process

    spec = tiny_spec(data, **MOE_FLAGS, train_iters=2)
    train_in_process(spec, tmp_path / "one")  # the one process: this one (a fresh interpreter's imports saved)
    run_train({**spec, "resources": {"nproc_per_node": 2}}, tmp_path / "two", 2)
    one, two = metric_rows(tmp_path / "one"), metric_rows(tmp_path / "two")
    for a, b in zip(one, two):
        for key in ("lm_loss", "grad_norm", "load_balancing_loss", "expert_load_imbalance_layer_0"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), key


def test_moe_step_gradient_is_lm_loss_plus_coeff_times_balance(
    data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1's gradient norm = that of lm_loss + coeff × sum over MoE layers of the switch loss, computed here from
    the router logits (one packed micro-batch; the model's own aux attachment switched off)."""
    from engine.model.moe import switch_balance_loss

    spec = tiny_spec(
        data, **{**MOE_FLAGS, "moe_aux_loss_coeff": 0.5}, train_iters=1, micro_batch_size=2, global_batch_size=2
    )
    _, first = _train_capturing(spec, tmp_path / "run", monkeypatch)
    (mb,) = first
    cfg = job.plan_run(parse_spec(spec), RunDir(tmp_path / "plan")).cfg
    ref = Qwen3Model(cfg.replace(moe_aux_loss_coeff=0.0))
    ref.init_weights(spec["seed"])
    logits: list[torch.Tensor] = []
    for layer in ref.decoder.layers.values():
        if hasattr(layer.mlp, "router"):
            layer.mlp.router.register_forward_hook(lambda m, args, out: logits.append(out))
    ref.train()
    objective = micro_batch_loss(ref, mb, 1024) / mb.num_loss_tokens
    for z in logits:
        probs = torch.softmax(z.float(), dim=-1)
        top = torch.topk(probs, cfg.moe_router_topk, dim=-1).indices.reshape(-1)
        counts = torch.bincount(top, minlength=cfg.num_experts or 0).float()
        objective = objective + 0.5 * switch_balance_loss(probs.sum(0), counts, z.shape[0], cfg.moe_router_topk)
    assert len(logits) == 1 and logits[0].shape[0] == mb.num_tokens  # packed: every routed token is real
    objective.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters()))
    assert metric_rows(tmp_path / "run")[0]["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
