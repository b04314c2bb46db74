"""Issue 39, finding 3: the API reads a Megatron rank file's ``data.pkl`` at submission for the model shape. A file
built to exhaust or crash its reader answers 422 naming ``load``, never 500, and the API's memory stays put."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import tracemalloc
import zipfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core.settings import Settings
from core_support import auth, make_token, team_dir
from engine.contract.plan.shape import checkpoint_config, config_from_checkpoint
from engine.contract.runfiles import BadInput


def _call(module: str, name: str, size: int) -> bytes:
    """``{"args": module.name(size)}`` in protocol-2 opcodes (what the probe wrote; no pickler makes these)."""
    raw = pickle.encode_long(size)
    return (
        b"\x80\x02}X\x04\x00\x00\x00args"
        + f"c{module}\n{name}\n".encode()
        + b"\x8a"
        + bytes([len(raw)])
        + raw
        + b"\x85Rs."
    )


def _namespace(**fields: object) -> bytes:
    return pickle.dumps({"args": argparse.Namespace(**fields), "iteration": 1}, protocol=2)


HOSTILE = {
    "bytes_2_56": _call("builtins", "bytes", 2**56),  # MemoryError before
    "bytes_2_64": _call("builtins", "bytes", 2**64),  # OverflowError before
    "bytearray_500M": _call("__builtin__", "bytearray", 500_000_000),  # 201 and +477 MB before
    "heads_x": _namespace(num_layers=2, hidden_size=8, num_attention_heads="x", padded_vocab_size=16),  # TypeError
}
GOOD = _namespace(num_layers=2, hidden_size=8, num_attention_heads=2, padded_vocab_size=16, ffn_hidden_size=16)


def _megatron_dir(root: Path, data_pkl: bytes) -> Path:
    """A Megatron checkpoint whose rank file is a ``torch.save`` zip holding ``data_pkl``."""
    rank = root / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    with zipfile.ZipFile(rank / "model_optim_rng.pt", "w") as zf:
        zf.writestr("archive/data.pkl", data_pkl)
        zf.writestr("archive/version", "3\n")
    return root


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("name", HOSTILE)
def test_the_reader_refuses_hostile_files_naming_the_field_within_a_few_mb(tmp_path: Path, name: str) -> None:
    root = _megatron_dir(tmp_path / name, HOSTILE[name])
    tracemalloc.start()
    try:
        with pytest.raises(BadInput) as err:
            checkpoint_config(root)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.field == "load" and "model_optim_rng.pt" in str(err.value)
    assert peak < 4 << 20, peak
    assert config_from_checkpoint(root) is None  # the planner's view: shape unknown


def test_a_good_rank_file_still_gives_its_shape(tmp_path: Path) -> None:
    cfg = checkpoint_config(_megatron_dir(tmp_path / "good", GOOD))
    assert cfg is not None and (cfg.num_layers, cfg.num_attention_heads, cfg.vocab_size) == (2, 2, 16)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_attention_heads": -2}, "num_attention_heads"),
        ({"num_layers": 10**12}, "num_layers"),
        ({"hidden_size": True}, "hidden_size"),
        ({"num_experts": 4, "mlp_only_layers": "all"}, "mlp_only_layers"),
        ({"rope_scaling_factor": float("nan")}, "rope_scaling_factor"),
    ],
)
def test_absurd_sizes_are_refused_by_name(tmp_path: Path, fields: dict[str, object], named: str) -> None:
    base = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "padded_vocab_size": 16}
    root = _megatron_dir(tmp_path / "ckpt", _namespace(**{**base, **fields}))
    with pytest.raises(BadInput, match=f"args: {named} is"):
        checkpoint_config(root)


def test_a_pickle_that_crashes_its_reader_is_refused_and_the_caller_lives(tmp_path: Path) -> None:
    """A million nested TUPLE1 used as a dict key: hashing it overflows the C stack (a segfault, no exception). In
    one protocol-4 frame: the reader then takes the opcodes from memory, not one budgeted read each (8.6 s at load 17,
    so past the reader's 10 s deadline at load 15, refused as slow instead of crashed; 2.6 s framed)."""
    body = b"}X\x04\x00\x00\x00args})" + b"\x85" * 1_000_000 + b"K\x01ss."
    bomb = b"\x80\x04\x95" + len(body).to_bytes(8, "little") + body
    with pytest.raises(BadInput, match="killed by signal|could not be read"):
        checkpoint_config(_megatron_dir(tmp_path / "bomb", bomb))


def test_only_the_args_at_the_head_of_a_large_file_are_read(tmp_path: Path) -> None:
    """Megatron writes args first: the reader stops there (a 40 MB rest past the byte budget is never read)."""
    state: dict[str, object] = {
        "args": argparse.Namespace(num_layers=2, hidden_size=8, num_attention_heads=2, padded_vocab_size=16)
    }
    state["model"] = {f"w{i}": "x" * 1000 for i in range(40_000)}
    cfg = checkpoint_config(_megatron_dir(tmp_path / "big", pickle.dumps(state, protocol=2)))
    assert cfg is not None and cfg.num_layers == 2


ROUTE_FILES = {**HOSTILE, "bomb": b"\x80\x02}X\x04\x00\x00\x00args})" + b"\x85" * 300_000 + b"K\x01ss."}


# serve takes every file through the route; eval (the same reader behind another kind's load) one of each way a
# refusal reaches the API: the reader's own (bytes_2_64), the shape's check after it (heads_x), the reader's crash
@pytest.mark.parametrize(
    ("kind", "names"),
    [("serve", list(ROUTE_FILES)), ("eval", ["bytes_2_64", "heads_x", "bomb"])],
    ids=["serve", "eval"],
)
def test_hostile_rank_files_answer_422_through_the_submission_route(
    client: TestClient, settings: Settings, kind: str, names: list[str]
) -> None:
    token = make_token(settings, "alpha")
    area = team_dir(settings, "alpha")
    for name, data in ((n, ROUTE_FILES[n]) for n in names):
        _megatron_dir(area / name, data)
        body = {"kind": kind, "load": name, "tokenizer_name_or_path": "tok"}
        if kind == "eval":
            body["eval_data_path"] = "in.jsonl"
        before = _rss()
        answer = client.post("/v1/jobs", json=body, headers=auth(token))
        grown = _rss() - before
        assert answer.status_code == 422, (name, answer.text)
        assert answer.json()["field"] == "load" and "model_optim_rng.pt" in answer.json()["message"]
        assert grown < 16 << 20, (name, grown)
    assert client.get("/v1/jobs", headers=auth(token)).json()["data"] == []


def _hf_dir(root: Path, layers: int) -> None:
    root.mkdir()
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8, "intermediate_size": 16}
    config |= {"vocab_size": 16, "num_hidden_layers": layers, "num_local_experts": 4, "model_type": "qwen3_moe"}
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(b"")


def test_other_shape_files_are_bounded_too(client: TestClient, settings: Settings) -> None:
    """A config.json with 10**12 MoE layers (its per-layer pattern was built before: a hang), a 2 MB config.json,
    and a tracker holding a digit ``int`` cannot read (a ValueError, 500 before; now the shape is unknown and the engine
    names the tracker at run time)."""
    token = make_token(settings, "alpha")
    area = team_dir(settings, "alpha")
    _hf_dir(area / "layers", 10**12)
    _hf_dir(area / "huge", 2)
    (area / "huge" / "config.json").write_text(json.dumps({"pad": "x" * (2 << 20)}))
    _megatron_dir(area / "tracker", GOOD)
    (area / "tracker" / "latest_checkpointed_iteration.txt").write_text("²")
    for name, status in (("layers", 422), ("huge", 422), ("tracker", 201)):
        body = {"kind": "serve", "load": name, "tokenizer_name_or_path": "tok"}
        answer = client.post("/v1/jobs", json=body, headers=auth(token))
        assert answer.status_code == status, (name, answer.text)
        assert status == 201 or answer.json()["field"] == "load", answer.text
