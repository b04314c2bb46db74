"""Building the eval model: flags vs checkpoint shape, weight/shape checks, LoRA adapters applied without merging,
Hugging Face PEFT adapters merged."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.checkpoint.sharded import fill_parts
from engine.checkpoint.sources import TensorDict
from engine.contract.model_config import preset
from engine.contract.runfiles import BadInput
from engine.contract.spec import parse_spec
from engine.load.adapters import check_adapters, wrap_adapters
from engine.model.lora import LoRALinear, apply_lora, lora_state_dict
from engine.model.qwen3 import Qwen3Model

CFG = preset("qwen3-tiny").replace(vocab_size=512)


def _spec(**fields):
    return parse_spec({"kind": "eval", "load": "ckpt", "eval_data_path": "test.jsonl", **fields})


def _base() -> Qwen3Model:
    model = Qwen3Model(CFG)
    model.init_weights(seed=0)
    return model.eval()


def test_lora_adapters_are_applied_unmerged_and_reproduce_the_trained_model() -> None:
    base = _base()
    trained = copy.deepcopy(base)
    apply_lora(trained, r=4, alpha=8, targets=["linear_qkv", "linear_fc2"], seed=0)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)  # as if trained: B starts at zero
    adapters = check_adapters(_spec(lora_load="adapters"), lora_state_dict(trained), {"alpha": 8})
    info = adapters.facts()
    with torch.device("meta"):  # as build_model does: wrapped on meta, filled from the base and the adapters
        model = Qwen3Model(CFG)
    wrap_adapters(model, adapters)
    model = model.to_empty(device="cpu").eval()
    fill_parts([model], TensorDict(CFG, base.state_dict()), TensorDict(CFG, adapters.lora))
    assert info["lora_r"] == 4 and info["lora_alpha"] == 8 and info["lora_targets"] == ["linear_fc2", "linear_qkv"]
    assert isinstance(model.decoder.layers["0"].self_attention.linear_qkv, LoRALinear)
    # not merged: the base matrices are the base checkpoint's
    assert torch.equal(model.decoder.layers["1"].mlp.linear_fc2.weight, base.decoder.layers["1"].mlp.linear_fc2.weight)
    ids = torch.randint(0, CFG.vocab_size, (2, 7))
    with torch.no_grad():
        assert torch.allclose(model(ids), trained(ids), atol=1e-6)
        assert not torch.allclose(model(ids), base(ids), atol=1e-3)


def test_lora_rank_flag_must_match_the_adapters() -> None:
    trained = _base()
    apply_lora(trained, r=4, alpha=8)
    with pytest.raises(BadInput, match="lora_r: 8 but the adapters in adapters have rank 4"):
        check_adapters(_spec(lora_load="adapters", lora_r=8), lora_state_dict(trained))
    with pytest.raises(BadInput, match="holds no LoRA tensors"):
        check_adapters(_spec(lora_load="adapters"), _base().state_dict())


def _peft_adapter(hf_dir, out, **config):
    """A PEFT LoRA adapter with random (trained-looking) A and B, saved by peft; returns the peft model."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(3)
    base = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(out)
    return model.eval()


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_hf_peft_adapter_is_merged_and_gives_peft_logits(tmp_path, rslora: bool) -> None:
    from convert_tiny import tiny_hf
    from engine.load.inference import build_model

    hf_dir = tiny_hf(tmp_path / "hf", tied=False, layers=2)
    # q and v only (PEFT's classic targets: k gets no delta), o and the MLP's gate/down
    peft_model = _peft_adapter(
        hf_dir,
        tmp_path / "adapter",
        r=4,
        lora_alpha=8,
        use_rslora=rslora,
        target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    )
    model, _, info = build_model(_spec(load=str(hf_dir), lora_load=str(tmp_path / "adapter")))
    assert info["lora_format"] == "peft" and info["lora_merged"] and info["lora_r"] == 4
    assert info["lora_targets"] == ["down_proj", "gate_proj", "o_proj", "q_proj", "v_proj"]
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), peft_model(input_ids=ids).logits
        base = build_model(_spec(load=str(hf_dir)))[0](ids)
    assert torch.allclose(ours, theirs, atol=2e-5), (ours - theirs).abs().max()
    assert not torch.allclose(base, theirs, atol=1e-2)  # the adapter matters


def test_peft_adapters_a_merge_cannot_reproduce_are_refused(tmp_path) -> None:
    from convert_tiny import tiny_hf
    from engine.load.inference import build_model

    hf_dir = tiny_hf(tmp_path / "hf", tied=False, layers=2)
    _peft_adapter(hf_dir, tmp_path / "dora", r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"])
    with pytest.raises(BadInput, match=r"only plain LoRA adapters can be merged here \(use_dora=True\)") as err:
        build_model(_spec(load=str(hf_dir), lora_load=str(tmp_path / "dora")))
    assert err.value.field == "lora_load"
    _peft_adapter(hf_dir, tmp_path / "plain", r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(BadInput, match="lora_r: 8 but the adapter"):
        build_model(_spec(load=str(hf_dir), lora_load=str(tmp_path / "plain"), lora_r=8))
