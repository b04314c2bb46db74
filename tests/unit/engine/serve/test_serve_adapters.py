"""Several LoRA adapters over one base (``engine.serve.adapters``): in one mixed batch, each sequence decodes exactly
as the model with only its own adapter (``engine.model.lora.LoRALinear``) would, and base rows as the bare base."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine.contract.model_config import preset
from engine.contract.runfiles import BadInput
from engine.load.adapters import Adapters
from engine.model.hf_mapping import native_from_hf
from engine.model.lora import apply_lora, lora_state_dict
from engine.model.qwen3 import Qwen3Model
from engine.serve.adapters import apply_adapters
from engine.serve.batcher import Batcher, Sequence
from engine.serve.sampling import RequestOptions
from engine.serve.slots import SlotCache

STOP = 1


@pytest.fixture(scope="module")
def base() -> Qwen3Model:
    cfg = dataclasses.replace(preset("qwen3-tiny"), vocab_size=512)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**{**cfg.to_hf("float32"), "initializer_range": 0.5})).eval()
    model = Qwen3Model(cfg)
    model.load_state_dict(dict(native_from_hf(hf.state_dict().__getitem__, cfg)), strict=True)
    return model.eval()


def _trained(base: Qwen3Model, seed: int, r: int, alpha: float, targets: list[str]) -> Qwen3Model:
    """``base`` with one LoRA adapter whose B is not zero (as after training)."""
    model = copy.deepcopy(base)
    apply_lora(model, r=r, alpha=alpha, targets=targets, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def _adapters(model: Qwen3Model, r: int, alpha: float, targets: list[str]) -> Adapters:
    return Adapters({}, lora_state_dict(model), r, alpha, targets)


def _run(batcher: Batcher, seqs: list[Sequence]) -> list[list[int]]:
    pending = list(seqs)
    while pending or batcher.busy:
        if pending:
            batcher.submit([pending.pop(0)])
        batcher.step()
    return [s.output for s in seqs]


def _greedy(model, prompts: list[list[int]], adapter: list[int] | None = None, selector=None) -> list[list[int]]:
    batcher = Batcher(model, SlotCache(model.cfg, 4, 64), {STOP}, prefill_chunk=5, adapters=selector)
    opts = RequestOptions(temperature=0.0)
    adapter = adapter or [0] * len(prompts)
    return _run(batcher, [Sequence(p, opts, 8, adapter=a) for p, a in zip(prompts, adapter, strict=True)])


def test_each_sequence_decodes_with_its_own_adapter_in_one_batch(base) -> None:
    one = _trained(base, seed=1, r=4, alpha=8.0, targets=["linear_qkv", "linear_fc2"])
    two = _trained(base, seed=2, r=2, alpha=4.0, targets=["linear_proj", "linear_fc1", "linear_qkv"])
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (9, 3, 7)]
    expected = {0: _greedy(base, prompts), 1: _greedy(one, prompts), 2: _greedy(two, prompts)}
    assert expected[0] != expected[1] and expected[1] != expected[2] and expected[0] != expected[2]

    served = copy.deepcopy(base)
    named = {
        "one": _adapters(one, 4, 8.0, ["linear_qkv", "linear_fc2"]),
        "two": _adapters(two, 2, 4.0, ["linear_fc1", "linear_proj", "linear_qkv"]),
    }
    selector, indices = apply_adapters(served, named)
    assert indices == {"one": 1, "two": 2}
    # every prompt under every adapter, interleaved, through 4 slots: batches always mix adapters
    order = [(i, a) for i in range(len(prompts)) for a in (2, 0, 1)]
    outputs = _greedy(served, [prompts[i] for i, _ in order], [a for _, a in order], selector)
    for (i, a), out in zip(order, outputs, strict=True):
        assert out == expected[a][i], f"prompt {i}, adapter {a}"


def test_adapters_that_do_not_fit_are_refused_by_name(base) -> None:
    one = _trained(base, seed=1, r=4, alpha=8.0, targets=["linear_qkv"])
    bad = _adapters(one, 4, 8.0, ["linear_qkv"])
    key = "decoder.layers.0.self_attention.linear_qkv.lora_B.weight"
    bad.lora[key] = bad.lora[key][:-1]
    with pytest.raises(BadInput, match="lora_adapters.broken: decoder.layers.0.self_attention.linear_qkv") as err:
        apply_adapters(copy.deepcopy(base), {"broken": bad})
    assert err.value.field == "lora_adapters.broken"
