"""LoRA: merging MindSpeed checkpoints per TP shard equals peft's merge_and_unload; the PEFT export loads in peft;
a PEFT adapter directory merges as peft merges it."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch

from convert_tiny import read_hf, tiny_hf
from engine.checkpoint.hf import HFCheckpoint
from engine.checkpoint.job import run
from engine.checkpoint.layout import chunk_keys, pipeline_chunks, shard, split_rule
from engine.checkpoint.megatron_write import build_args, save_mcore
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import RunDir
from engine.contract.spec import ConvertSpec
from engine.model.hf_mapping import fuse_fc1, fuse_qkv
from engine.model.lora import to_mindspeed_keys

R, ALPHA = 4, 8.0
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_adapters(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """PEFT-space adapters; q/k/v share one A and gate/up share one A (what a fused Megatron LoRA can express)."""
    g = torch.Generator().manual_seed(3)
    rnd = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    h, d, ffn = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    out = {}
    for i in range(cfg.num_layers):
        p = f"base_model.model.model.layers.{i}."
        a_qkv, a_fc1 = rnd(R, h), rnd(R, h)
        rows = {
            "q_proj": cfg.num_attention_heads * d,
            "k_proj": cfg.num_query_groups * d,
            "v_proj": cfg.num_query_groups * d,
        }
        for name, n in rows.items():
            out[p + f"self_attn.{name}.lora_A.weight"], out[p + f"self_attn.{name}.lora_B.weight"] = a_qkv, rnd(n, R)
        out[p + "self_attn.o_proj.lora_A.weight"], out[p + "self_attn.o_proj.lora_B.weight"] = (
            rnd(R, cfg.num_attention_heads * d),
            rnd(h, R),
        )
        for name in ("gate_proj", "up_proj"):
            out[p + f"mlp.{name}.lora_A.weight"], out[p + f"mlp.{name}.lora_B.weight"] = a_fc1, rnd(ffn, R)
        out[p + "mlp.down_proj.lora_A.weight"], out[p + "mlp.down_proj.lora_B.weight"] = rnd(R, ffn), rnd(h, R)
    return out


def _native_adapters(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The same adapters on Megatron's fused modules (full, TP1), engine key names."""
    out = {}
    for i in range(cfg.num_layers):
        p, n = f"base_model.model.model.layers.{i}.", f"decoder.layers.{i}."
        b = lambda m, p=p: hf[p + m + ".lora_B.weight"]  # noqa: E731
        out[n + "self_attention.linear_qkv.lora_A.weight"] = hf[p + "self_attn.q_proj.lora_A.weight"]
        out[n + "self_attention.linear_qkv.lora_B.weight"] = fuse_qkv(
            b("self_attn.q_proj"), b("self_attn.k_proj"), b("self_attn.v_proj"), cfg
        )
        out[n + "self_attention.linear_proj.lora_A.weight"] = hf[p + "self_attn.o_proj.lora_A.weight"]
        out[n + "self_attention.linear_proj.lora_B.weight"] = b("self_attn.o_proj")
        out[n + "mlp.linear_fc1.lora_A.weight"] = hf[p + "mlp.gate_proj.lora_A.weight"]
        out[n + "mlp.linear_fc1.lora_B.weight"] = fuse_fc1(b("mlp.gate_proj"), b("mlp.up_proj"))
        out[n + "mlp.linear_fc2.lora_A.weight"] = hf[p + "mlp.down_proj.lora_A.weight"]
        out[n + "mlp.linear_fc2.lora_B.weight"] = b("mlp.down_proj")
    return out


def _mindspeed_lora(
    base: Path, out: Path, adapters: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, pp: int, adapters_only: bool
) -> Path:
    """Rewrite a base checkpoint as MindSpeed saves a LoRA run: base_layer / lora_A.default / lora_B.default."""
    shutil.copytree(base, out)
    for p, chunks in enumerate(pipeline_chunks(cfg.num_layers, pp)):
        for t in range(tp):
            path = (
                out
                / "iter_0000001"
                / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
                / "model_optim_rng.pt"
            )
            state = torch.load(path, weights_only=False)
            model = {} if adapters_only else dict(state["model"])
            for local, native in chunk_keys(cfg, chunks[0], pp):
                module = native.removesuffix(".weight")
                if module + ".lora_A.weight" not in adapters:
                    continue
                lmod = local.removesuffix(".weight")
                for ab in "AB":
                    key = f"{module}.lora_{ab}.weight"
                    model[f"{lmod}.lora_{ab}.default.weight"] = shard(adapters[key], split_rule(key), tp, t)
                model[lmod + "._extra_state"] = None
                if not adapters_only:
                    model[lmod + ".base_layer.weight"] = model.pop(local)
            state["model"] = model
            torch.save(state, path)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    hf_dir = tiny_hf(root / "hf", tied=False)
    src = HFCheckpoint(hf_dir)
    save_mcore(src, src.config, root / "base", tp=2, pp=2)
    hf_adapters = _hf_adapters(src.config)
    native = _native_adapters(hf_adapters, src.config)
    return {
        "root": root,
        "hf": hf_dir,
        "cfg": src.config,
        "hf_adapters": hf_adapters,
        "native": native,
        "unified": _mindspeed_lora(root / "base", root / "unified", native, src.config, 2, 2, False),
        "filtered": _mindspeed_lora(root / "base", root / "filtered", native, src.config, 2, 2, True),
    }


@pytest.fixture(scope="module")
def peft_merged(setup: dict) -> dict[str, torch.Tensor]:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=HF_TARGETS, lora_dropout=0.0))
    result = peft_model.load_state_dict(
        {k.replace(".weight", ".default.weight"): v for k, v in setup["hf_adapters"].items()}, strict=False
    )
    assert not result.unexpected_keys
    return {k: v.detach().clone() for k, v in peft_model.merge_and_unload().state_dict().items()}


def _convert(setup: dict, name: str, **fields: object) -> Path:
    out = setup["root"] / name
    spec = ConvertSpec(load_model_type="mg", save_model_type="hf", save_dir=str(out), **fields)
    run(spec, RunDir(setup["root"] / f"run-{name}"))
    return out


def _assert_equal_to_peft(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == reference.keys()
    for key, value in ours.items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=1e-6, msg=key)


def test_unified_merge_equals_peft_merge_and_unload(setup: dict, peft_merged: dict) -> None:
    out = _convert(
        setup,
        "merged-unified",
        load_dir=str(setup["unified"]),
        lora_r=R,
        lora_alpha=ALPHA,
        lora_target_modules="linear_qkv linear_proj linear_fc1 linear_fc2",
    )
    ours, base = read_hf(out), read_hf(setup["hf"])
    _assert_equal_to_peft(ours, peft_merged)
    assert not torch.equal(
        ours["model.layers.2.self_attn.k_proj.weight"], base["model.layers.2.self_attn.k_proj.weight"]
    )


def test_lora_load_overlay_same_layout_and_alpha_r_ratio(setup: dict, peft_merged: dict) -> None:
    # Only alpha/r matters (the seed merges an r=16/alpha=32 run with r=8/alpha=16).
    out = _convert(
        setup,
        "merged-overlay",
        load_dir=str(setup["root"] / "base"),
        lora_load=str(setup["filtered"]),
        lora_r=2 * R,
        lora_alpha=2 * ALPHA,
    )
    _assert_equal_to_peft(read_hf(out), peft_merged)


def test_trainer_adapters_only_checkpoint_on_a_differently_sharded_base(setup: dict, peft_merged: dict) -> None:
    cfg = setup["cfg"]
    lora_dir = setup["root"] / "trainer-lora"
    rank = lora_dir / "iter_0000007" / "mp_rank_00"
    rank.mkdir(parents=True)
    args = argparse.Namespace(**{**vars(build_args(cfg, 1, 1, torch.float32)), "lora_r": R, "lora_alpha": ALPHA})
    torch.save(
        {"args": args, "checkpoint_version": 3.0, "iteration": 7, "model": to_mindspeed_keys(setup["native"])},
        rank / "model_optim_rng.pt",
    )
    (lora_dir / "latest_checkpointed_iteration.txt").write_text("7")
    out = _convert(setup, "merged-trainer", load_dir=str(setup["root"] / "base"), lora_load=str(lora_dir))
    _assert_equal_to_peft(read_hf(out), peft_merged)


def test_peft_export_loads_in_peft(setup: dict, peft_merged: dict) -> None:
    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    out = _convert(setup, "adapter", load_dir=str(setup["unified"]), lora_r=R, lora_alpha=ALPHA, save_lora_to_hf=True)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = Qwen3ForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out)
    merged = {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}
    for key, value in peft_merged.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=1e-6, msg=key)


def test_adapters_without_alpha_and_r_are_refused(setup: dict) -> None:
    from engine.contract.runfiles import BadInput

    with pytest.raises(BadInput, match="give lora_r and lora_alpha"):
        _convert(setup, "no-ratio", load_dir=str(setup["unified"]))
    with pytest.raises(BadInput, match="lora_target_modules: the checkpoint has adapters on linear_fc1, linear_fc2"):
        _convert(
            setup,
            "stray",
            load_dir=str(setup["unified"]),
            lora_r=R,
            lora_alpha=ALPHA,
            lora_target_modules="linear_qkv linear_proj",
        )


@pytest.mark.parametrize("base", ["hf", "mg"])
def test_hf_peft_adapter_merges_onto_hf_and_megatron_bases(setup: dict, tmp_path: Path, base: str) -> None:
    """An adapter trained with peft (its own A per q/k/v module, k without one) merged by --lora-load."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(5)
    model = Qwen3ForCausalLM.from_pretrained(setup["hf"], dtype=torch.float32)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=R, lora_alpha=ALPHA, init_lora_weights=False, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]
        ),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    reference = {k: v.detach().clone() for k, v in peft_model.merge_and_unload().state_dict().items()}
    spec = ConvertSpec(
        load_model_type=base,
        save_model_type="hf",
        save_dir=str(tmp_path / "out"),
        load_dir=str(setup["hf"] if base == "hf" else setup["root"] / "base"),
        lora_load=str(tmp_path / "adapter"),
    )
    _, summary = run(spec, RunDir(tmp_path / "run"))
    assert summary["lora_merged"]
    ours = read_hf(tmp_path / "out")
    _assert_equal_to_peft(ours, reference)
    original = read_hf(setup["hf"])
    assert torch.equal(
        ours["model.layers.1.self_attn.k_proj.weight"], original["model.layers.1.self_attn.k_proj.weight"]
    )
    assert not torch.equal(
        ours["model.layers.1.self_attn.v_proj.weight"], original["model.layers.1.self_attn.v_proj.weight"]
    )
