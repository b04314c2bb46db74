"""A Hugging Face PEFT adapter folder (made by ``peft`` itself) is checked at submission against the base it is
served or evaluated over: its LoRA factors' widths are read from the safetensors header (no torch in the API) and an
adapter of another model's shape is refused naming the field, as is a folder whose files are not an adapter, and a
PEFT adapter chosen per request (the engine merges it at load)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from core_support import auth, isolated_settings, make_token, team_dir

BASE = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}


def _peft_adapter(out: Path, **shape: int) -> None:
    """A LoRA adapter saved by peft over a tiny random Qwen3 of ``shape`` (attention and MLP projections)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **{**BASE, **shape})
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(Qwen3ForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    model.save_pretrained(str(out))
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    made = {"fits": {}, "narrow": {"hidden_size": 32}, "deep": {"num_hidden_layers": 4}, "wide_mlp": {}}
    made["wide_mlp"] = {"intermediate_size": 96}
    for name, shape in made.items():
        _peft_adapter(root / name, **shape)
    return {name: root / name for name in made}


@pytest.fixture
def api(tmp_path: Path, adapters: dict[str, Path]) -> Iterator[TestClient]:
    from app.main import create_app

    settings = isolated_settings(tmp_path)
    area = team_dir(settings, "alpha")
    (area / "base").mkdir()
    hf = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        **BASE,
    }
    (area / "base" / "config.json").write_text(json.dumps(hf))
    (area / "tok").mkdir()
    for name, path in adapters.items():
        shutil.copytree(path, area / name)
    with TestClient(create_app(settings, reconcile=False), headers=auth(make_token(settings, "alpha"))) as client:
        client.app.state.area = area  # type: ignore[attr-defined]
        yield client


def serve(**extra: Any) -> dict[str, Any]:
    return {"kind": "serve", "load": "base", "tokenizer_name_or_path": "tok", **extra}


def refusal(api: TestClient, body: dict[str, Any]) -> tuple[int, str, str]:
    answer = api.post("/v1/jobs", json=body)
    payload = answer.json()
    return answer.status_code, payload.get("field", ""), payload.get("message", "")


def test_an_adapter_of_the_bases_shape_is_admitted_as_lora_load(api: TestClient) -> None:
    answer = api.post("/v1/jobs", json=serve(lora_load="fits"))
    assert answer.status_code == 201, answer.text


@pytest.mark.parametrize(
    ("adapter", "said"),
    [
        ("narrow", "[32, 4]: 32 outputs, but the base's (load) mlp.down_proj has 64 (hidden_size 64)"),
        ("deep", "is for layer 2; the base (load) has 2 layers"),
        ("wide_mlp", "[4, 96]: 96 inputs, but the base's (load) mlp.down_proj has 128"),
    ],
)
def test_an_adapter_of_another_shape_is_refused_naming_the_field(api: TestClient, adapter: str, said: str) -> None:
    status, field, message = refusal(api, serve(lora_load=adapter))
    assert (status, field) == (422, "lora_load"), message
    assert "holds adapters for another model" in message and said in message, message
    status, field, message = refusal(api, serve(lora_adapters={"jazz": adapter}))
    assert (status, field) == (422, "lora_adapters.jazz"), message
    assert said in message, message


def test_a_peft_adapter_is_not_chosen_per_request(api: TestClient) -> None:
    status, field, message = refusal(api, serve(lora_adapters={"jazz": "fits"}))
    assert (status, field) == (422, "lora_adapters.jazz"), message
    assert "cannot be chosen per request; give it as lora_load" in message


def _spoil(api: TestClient, name: str, weights: bytes | None) -> str:
    area: Path = api.app.state.area  # type: ignore[attr-defined]
    shutil.copytree(area / "fits", area / name)
    target = area / name / "adapter_model.safetensors"
    if weights is None:
        target.unlink()
    else:
        target.write_bytes(weights)
    return name


@pytest.mark.parametrize(
    ("weights", "said"),
    [
        (None, "adapter_model.safetensors is missing"),
        (struct.pack("<Q", 1 << 62) + b"{}", "not a safetensors file (a header of"),
        (struct.pack("<Q", 6) + b"\xff\xfe{]x!", "its header is not JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (b"\x01", "not a safetensors file"),
    ],
)
def test_files_that_are_no_adapter_are_refused_not_a_500(api: TestClient, weights: bytes | None, said: str) -> None:
    name = _spoil(api, "spoiled", weights)
    status, field, message = refusal(api, serve(lora_load=name))
    assert (status, field) == (422, "lora_load"), message
    assert said in message, message


def test_a_tensor_without_a_shape_is_refused(api: TestClient) -> None:
    header = json.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {"dtype": "F32"}}).encode()
    name = _spoil(api, "shapeless", struct.pack("<Q", len(header)) + header)
    status, field, message = refusal(api, serve(lora_load=name))
    assert (status, field) == (422, "lora_load") and "has no shape" in message, message
