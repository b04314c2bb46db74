"""LoRA converter: only adapters train, merged weights reproduce the LoRA model, names and targets."""

from __future__ import annotations

import pytest
import torch

from engine.contract.lora_targets import HF_TO_MEGATRON, resolve_targets
from engine.contract.model_config import ModelConfig
from engine.model.hf_mapping import HF_MODULES
from engine.model.lora import (
    LoRALinear,
    apply_lora,
    from_mindspeed_keys,
    load_lora_state_dict,
    lora_state_dict,
    merge_into,
    merge_lora,
    to_mindspeed_keys,
)
from engine.model.loss import chunked_cross_entropy
from engine.model.qwen3 import Qwen3Model

VOCAB = 256
CFG = ModelConfig(2, 32, 64, 4, 2, 8, vocab_size=VOCAB, tie_word_embeddings=True)


def base_model(seed: int = 0) -> Qwen3Model:
    m = Qwen3Model(CFG)
    m.init_weights(seed)
    return m


def train_steps(model: Qwen3Model, steps: int = 3) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        hidden = model(ids, return_hidden=True)
        loss, n = chunked_cross_entropy(hidden[:, :-1], model.output_weight(), ids[:, 1:])
        (loss / n).backward()
        opt.step()
        opt.zero_grad()


def test_only_adapters_train_and_base_is_untouched() -> None:
    model = base_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = apply_lora(model, r=4, alpha=8, targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    assert len(wrapped) == 8
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    train_steps(model)
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key  # base keys unchanged and still the native names
    assert any(v.abs().sum() > 0 for k, v in lora_state_dict(model).items() if ".lora_B." in k)


def test_merged_weights_give_the_lora_model_logits() -> None:
    model = base_model()
    apply_lora(model, r=4, alpha=16, dropout=0.1, targets=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    train_steps(model)
    model.eval()  # dropout off
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        lora_logits = model(ids)
        adapters = lora_state_dict(model)
        assert merge_into(model)
        merged_logits = model(ids)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert set(model.state_dict()) == set(base_model().state_dict())
    assert (lora_logits - merged_logits).abs().max().item() <= 1e-5
    # the functional merge (what the converter uses) agrees with the merged module
    key = "decoder.layers.0.self_attention.linear_qkv"
    fresh = base_model()
    w = merge_lora(
        fresh.state_dict()[key + ".weight"],
        adapters[key + ".lora_A.weight"],
        adapters[key + ".lora_B.weight"],
        alpha=16,
        r=4,
    )
    torch.testing.assert_close(w, model.state_dict()[key + ".weight"])


def test_adapter_state_dict_round_trip_and_mindspeed_names() -> None:
    model = base_model()
    apply_lora(model, r=2, alpha=4, targets=["linear_fc1"])
    train_steps(model, steps=1)
    adapters = lora_state_dict(model)
    assert set(adapters) == {f"decoder.layers.{i}.mlp.linear_fc1.lora_{ab}.weight" for i in (0, 1) for ab in "AB"}
    assert adapters["decoder.layers.0.mlp.linear_fc1.lora_A.weight"].shape == (2, CFG.hidden_size)
    ms = to_mindspeed_keys(model.state_dict())
    assert "decoder.layers.0.mlp.linear_fc1.lora_A.default.weight" in ms
    assert "decoder.layers.0.mlp.linear_fc1.base_layer.weight" in ms
    assert "decoder.layers.0.mlp.linear_fc2.weight" in ms  # not a target: unchanged
    assert from_mindspeed_keys(ms).keys() == model.state_dict().keys()
    other = base_model()
    apply_lora(other, r=2, alpha=4, targets=["gate_proj", "up_proj"])
    load_lora_state_dict(other, to_mindspeed_keys(adapters))
    for key, value in adapters.items():
        assert torch.equal(other.state_dict()[key], value)


def test_targets_refuse_partial_fused_and_unknown_names() -> None:
    assert resolve_targets(["q_proj", "k_proj", "v_proj", "down_proj"]) == ["linear_qkv", "linear_fc2"]
    assert resolve_targets([]) == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    with pytest.raises(ValueError, match="lora_target_modules: .*q_proj.*fused linear_qkv"):
        resolve_targets(["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="linear_fc1"):
        resolve_targets(["gate_proj"])
    with pytest.raises(ValueError, match="unknown"):
        resolve_targets(["query_key_value"])


def test_target_names_are_the_key_maps() -> None:
    """The torch-free table the API checks specs with is the one HF <-> native key map's."""
    derived = {hf.rsplit(".", 1)[1]: native.rsplit(".", 1)[1] for native, hfs in HF_MODULES.items() for hf in hfs}
    assert derived == HF_TO_MEGATRON


def test_frozen_base_in_bf16_with_fp32_adapters() -> None:
    model = base_model()
    apply_lora(model, r=4, alpha=8, base_dtype=torch.bfloat16)
    assert model.decoder.layers["0"].mlp.linear_fc1.weight.dtype == torch.bfloat16
    assert model.decoder.layers["0"].mlp.linear_fc1.lora_A.weight.dtype == torch.float32
    train_steps(model, steps=1)
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)


def test_lora_on_meta_model_then_init_keeps_b_zero() -> None:
    """Build on meta, convert, materialise, init (torchtitan order): the model starts equal to its base."""
    with torch.device("meta"):
        model = Qwen3Model(CFG)
    apply_lora(model, r=4, alpha=8)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    lora = lora_state_dict(model)
    assert all(torch.all(v == 0) for k, v in lora.items() if ".lora_B." in k)
    assert all(v.abs().sum() > 0 for k, v in lora.items() if ".lora_A." in k)
    assert model.decoder.layers["0"].mlp.linear_fc2.weight.std() < 0.02  # base got Megatron's scaled init


def test_adapter_input_saved_in_the_compute_dtype_and_grads_match_fp32_path() -> None:
    """The input kept for A's gradient is the bf16 input itself, not an fp32 copy; the gradients are the ones the
    plain fp32 path (cast, then nn.Linear) gives."""
    torch.manual_seed(0)
    lin = LoRALinear(torch.nn.Linear(32, 48, bias=False).to(torch.bfloat16), r=4, alpha=8.0)
    torch.nn.init.normal_(lin.lora_B.weight)
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = lin(x)
    assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= x.numel()]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, lin.lora_A.weight, lin.lora_B.weight), g)
    low = lin.lora_B(lin.lora_A(x.float())) * lin.scaling
    ref = torch.nn.functional.linear(x, lin.weight) + low.to(torch.bfloat16)
    want = torch.autograd.grad(ref, (x, lin.lora_A.weight, lin.lora_B.weight), g)
    assert torch.equal(out, ref)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
