"""Finding 1: a checkpoint file must not run code. Each payload's ``__reduce__`` would create a marker file; the
load must refuse the class by name and the marker must not appear. Real Megatron-style files still load."""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import shutil
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from convert_tiny import tiny_hf
from engine.checkpoint import dcp
from engine.checkpoint.hf import HFCheckpoint
from engine.checkpoint.job import run
from engine.checkpoint.lora_merge import peft_deltas
from engine.checkpoint.megatron_read import MODEL_FILE, load_rank_file
from engine.checkpoint.megatron_write import save_mcore
from engine.checkpoint.safe_pickle import SafeLoadPlanner, load_torch_file
from engine.cli import main
from engine.contract.plan.shape import config_from_checkpoint
from engine.contract.runfiles import EXIT_BAD_INPUT, BadInput, RunDir
from engine.contract.spec import ConvertSpec


class Payload:
    """Unpickling this would call ``open(marker, "w")``: harmless, but proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


REFUSED = r"refusing to unpickle .*open"


@pytest.fixture(scope="module")
def mg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = tiny_hf(tmp_path_factory.mktemp("hf") / "model", tied=False, layers=2)
    src = HFCheckpoint(hf)
    out = tmp_path_factory.mktemp("mg") / "ckpt"
    save_mcore(src, src.config, out, tp=1, pp=1)
    return out


def _rank_file(root: Path) -> Path:
    return next(root.rglob(MODEL_FILE))


def _poison(mg_dir: Path, tmp_path: Path, zip_format: bool) -> tuple[Path, Path]:
    root = Path(shutil.copytree(mg_dir, tmp_path / "ckpt"))
    marker = tmp_path / "marker"
    rank = _rank_file(root)
    state = load_rank_file(rank)
    state["args"].evil = Payload(marker)
    torch.save(state, rank, _use_new_zipfile_serialization=zip_format)
    return root, marker


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_poisoned_megatron_rank_file_is_refused_by_the_convert_job(
    mg_dir: Path, tmp_path: Path, zip_format: bool
) -> None:
    root, marker = _poison(mg_dir, tmp_path, zip_format)
    spec = ConvertSpec(load_model_type="mg", save_model_type="hf", load_dir=str(root), save_dir=str(tmp_path / "out"))
    with pytest.raises(BadInput, match=REFUSED) as err:
        run(spec, RunDir(tmp_path / "run"))
    assert err.value.field == "load_dir"
    assert not marker.exists()


def test_real_megatron_args_still_load(tmp_path: Path) -> None:
    """What Megatron-LM's save_checkpoint writes: args with dtypes and Megatron-Core's enums, NumPy/torch RNG."""
    enums = pytest.importorskip("megatron.core.transformer.enums")
    core_enums = pytest.importorskip("megatron.core.enums")
    args = argparse.Namespace(
        num_layers=2,
        params_dtype=torch.bfloat16,
        attention_backend=enums.AttnBackend.auto,
        model_type=core_enums.ModelType.encoder_or_decoder,
        data_path=["a", "b"],
    )
    rng = [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {"model-parallel-rng": torch.ones(3)},
        }
    ]
    for zip_format in (True, False):
        path = tmp_path / f"model_optim_rng_{zip_format}.pt"
        torch.save(
            {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": 5,
                "rng_state": rng,
                "model": {"w": torch.arange(4.0)},
            },
            path,
            _use_new_zipfile_serialization=zip_format,
        )
        loaded = load_rank_file(path)
        assert loaded["args"].params_dtype == torch.bfloat16
        assert loaded["args"].attention_backend.value == enums.AttnBackend.auto.value
        assert loaded["args"].data_path == ["a", "b"]
        assert torch.equal(loaded["model"]["w"], torch.arange(4.0))
    assert (
        load_torch_file(tmp_path / "model_optim_rng_False.pt")["rng_state"][0]["np_rng_state"][1]
        == np.random.get_state()[1]
    ).all()


@pytest.fixture
def dcp_checkpoint(tmp_path: Path) -> Path:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        yield dcp.save(tmp_path / "save", 1, model, optimizer, {"x": 1})
    finally:
        dist.destroy_process_group()


def _load(ckpt: Path) -> None:
    model = torch.nn.Linear(4, 4)
    dcp.load(ckpt, model, torch.optim.AdamW(model.parameters()))


def test_dcp_checkpoint_round_trips(dcp_checkpoint: Path) -> None:
    _load(dcp_checkpoint)
    meta, state = dcp.load_model_weights(dcp_checkpoint)
    assert meta["x"] == 1 and set(state) == {"weight", "bias"}


@pytest.mark.parametrize("victim", ["rng_rank0.pt", ".metadata"])
def test_poisoned_dcp_file_is_refused(dcp_checkpoint: Path, tmp_path: Path, victim: str) -> None:
    marker = tmp_path / "marker"
    path = dcp_checkpoint / victim
    if victim.endswith(".pt"):
        torch.save({"python": Payload(marker)}, path)
    else:
        with path.open("wb") as f:
            pickle.dump(Payload(marker), f)
    with pytest.raises(BadInput, match=REFUSED):
        _load(dcp_checkpoint)
    assert not marker.exists()


# The legacy (pre-zip) torch.save layout is five pickles in a row; torch.load reads all but the object with
# pickle_module.load (issue 25: the payload ran from the magic number's place before "Invalid magic number").
LEGACY_STAGES = ("magic_number", "protocol_version", "sys_info", "object", "storage_keys")


def _legacy_bytes(
    marker: Path | None = None, stage: str = "", obj: object = None, raw_object: bytes | None = None
) -> bytes:
    """A legacy-format torch file holding ``obj`` (no tensors; or the pickle ``raw_object``), with
    ``Payload(marker)`` in place of ``stage``."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    sys_info = {"protocol_version": PROTOCOL_VERSION, "little_endian": True, "type_sizes": {"short": 2, "int": 4}}
    parts = dict(zip(LEGACY_STAGES, (MAGIC_NUMBER, PROTOCOL_VERSION, sys_info, obj or {"iteration": 1}, [])))
    if marker is not None:
        parts[stage] = Payload(marker)
    pickles = {name: pickle.dumps(part, protocol=2) for name, part in parts.items()}
    if raw_object is not None:
        pickles["object"] = raw_object
    return b"".join(pickles.values())


def test_the_legacy_file_written_here_is_what_torch_reads(tmp_path: Path) -> None:
    """The poisoned files below differ from a readable one only by the payload."""
    (tmp_path / "f.pt").write_bytes(_legacy_bytes(obj={"args": argparse.Namespace(x=1)}))
    assert load_torch_file(tmp_path / "f.pt")["args"].x == 1


@pytest.mark.parametrize("stage", LEGACY_STAGES)
def test_every_stage_of_a_legacy_file_goes_through_the_allow_list(tmp_path: Path, stage: str) -> None:
    path = tmp_path / "model_optim_rng.pt"
    path.write_bytes(_legacy_bytes(tmp_path / "marker", stage))
    with pytest.raises(BadInput, match=REFUSED):
        load_torch_file(path)
    with pytest.raises(BadInput, match=REFUSED):
        load_torch_file(io.BytesIO(path.read_bytes()))  # DCP's non-tensor items arrive as bytes
    assert not (tmp_path / "marker").exists()


def test_replay_legacy_rank_file_in_a_convert_job(mg_dir: Path, tmp_path: Path) -> None:
    """The probe's replay: a legacy-format model_optim_rng.pt whose first pickle is the payload, then a convert job
    through the engine's command line as the worker runs it: bad_input naming load_dir, nothing run, nothing
    written."""
    root = Path(shutil.copytree(mg_dir, tmp_path / "ckpt"))
    _rank_file(root).write_bytes(_legacy_bytes(tmp_path / "marker", "magic_number"))
    flags = ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(root)]
    code = main(["convert", *flags, "--save-dir", str(tmp_path / "out"), "--run-dir", str(tmp_path / "run")])
    assert code == EXIT_BAD_INPUT
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    (error,) = [e for e in events if e["type"] == "error"]
    assert error["data"] == {"code": "bad_input", "field": "load_dir"} and "refusing to unpickle" in error["message"]
    assert not (tmp_path / "marker").exists() and not (tmp_path / "out").exists()


def test_dcp_non_tensor_item_goes_through_the_allow_list(tmp_path: Path) -> None:
    """``SafeLoadPlanner.load_bytes`` (step counts, param-group floats, the optimizer's non-tensor state)."""
    for stage in ("magic_number", "object"):
        with pytest.raises(BadInput, match=REFUSED):
            SafeLoadPlanner().load_bytes(None, io.BytesIO(_legacy_bytes(tmp_path / "marker", stage)))
    assert not (tmp_path / "marker").exists()


def test_poisoned_legacy_rng_file_is_refused(dcp_checkpoint: Path, tmp_path: Path) -> None:
    (dcp_checkpoint / "rng_rank0.pt").write_bytes(_legacy_bytes(tmp_path / "marker", "sys_info"))
    with pytest.raises(BadInput, match=REFUSED):
        _load(dcp_checkpoint)
    assert not (tmp_path / "marker").exists()


def test_lazy_zip_reader_refuses_the_payload(mg_dir: Path, tmp_path: Path) -> None:
    """The converter's pread reader (``engine.checkpoint.reader.TorchZipFile``) of a zip rank file."""
    root, marker = _poison(mg_dir, tmp_path, zip_format=True)
    with pytest.raises(BadInput, match=REFUSED):
        load_rank_file(_rank_file(root), lazy=True)
    assert not marker.exists()


# GLOBAL argparse.Namespace, then BUILD with slot state {"pwned": 1}: would set ``argparse.Namespace.pwned``.
BUILD_ON_CLASS = b"\x80\x02cargparse\nNamespace\nN}X\x05\x00\x00\x00pwnedK\x01s\x86b."


def test_build_on_an_allowed_class_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f.pt").write_bytes(_legacy_bytes(raw_object=BUILD_ON_CLASS))
    with pytest.raises(BadInput, match="refusing to unpickle attributes set on the class argparse.Namespace"):
        load_torch_file(tmp_path / "f.pt")
    assert not hasattr(argparse.Namespace, "pwned")


def test_legacy_module_ids_are_refused(tmp_path: Path) -> None:
    """torch's legacy "module" persistent id compares class sources and may write a .patch file: refused."""

    class ModuleId(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("module", argparse.Namespace, "argparse.py", "changed source") if obj == "m" else None

    buf = io.BytesIO()
    ModuleId(buf, protocol=2).dump({"net": "m"})
    (tmp_path / "f.pt").write_bytes(_legacy_bytes(raw_object=buf.getvalue()))
    with pytest.raises(BadInput, match="refusing to unpickle the persistent id"):
        load_torch_file(tmp_path / "f.pt")


def test_legacy_tar_format_is_refused(tmp_path: Path) -> None:
    """torch < 0.4's tar layout extracts members to disk by name; refused before torch opens it."""
    path = tmp_path / "old.pt"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("storages")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(BadInput, match="tar checkpoint"):
        load_torch_file(path)


def test_submission_args_reader_refuses_the_payload(mg_dir: Path, tmp_path: Path) -> None:
    """The API's torch-free ``args`` reader (``engine.contract.plan.shape``) uses the same list: shape unknown, nothing run."""
    root, marker = _poison(mg_dir, tmp_path, zip_format=True)
    assert config_from_checkpoint(mg_dir) is not None  # the clean checkpoint's shape is read
    assert config_from_checkpoint(root) is None
    assert not marker.exists()


def test_pickle_weight_files_are_never_read(tmp_path: Path) -> None:
    """HF ``pytorch_model.bin`` and PEFT ``adapter_model.bin`` are pickles: only safetensors are read."""
    hf = tiny_hf(tmp_path / "hf", tied=False, layers=2)
    for st in hf.glob("*.safetensors"):
        st.unlink()
    torch.save({"w": Payload(tmp_path / "marker")}, hf / "pytorch_model.bin")
    with pytest.raises(BadInput, match="safetensors"):
        run(
            ConvertSpec(load_model_type="hf", save_model_type="mg", load_dir=str(hf), save_dir=str(tmp_path / "o")),
            RunDir(tmp_path / "run"),
        )
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 4}')
    torch.save({"w": Payload(tmp_path / "marker")}, adapter / "adapter_model.bin")
    with pytest.raises(BadInput, match="adapter_model.bin is not read"):
        peft_deltas(adapter, HFCheckpoint(tiny_hf(tmp_path / "hf2", tied=False, layers=2)).config)
    assert not (tmp_path / "marker").exists()


def test_dcp_metadata_naming_a_file_outside_the_checkpoint_is_refused(dcp_checkpoint: Path) -> None:
    """``.metadata`` names the data file of every item; DCP would open ``../secret`` as given."""
    path = dcp_checkpoint / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret"
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(BadInput, match="outside its directory"):
        _load(dcp_checkpoint)


# Issue 39, finding 6: GLOBAL torch._utils._rebuild_tensor_v2, then BUILD with a __dict__ state / a slot state.
BUILD_ON_FUNCTION = [
    b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n}X\x05\x00\x00\x00pwnedK\x01sb.",
    b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}X\x05\x00\x00\x00pwnedK\x01s\x86b.",
]


@pytest.mark.parametrize("raw", BUILD_ON_FUNCTION, ids=["dict_state", "slot_state"])
def test_build_on_an_allowed_function_is_refused(tmp_path: Path, raw: bytes) -> None:
    """BUILD would set ``_rebuild_tensor_v2.pwned`` for every later load in the process."""
    (tmp_path / "f.pt").write_bytes(_legacy_bytes(raw_object=raw))
    with pytest.raises(BadInput, match="attributes set on torch._utils._rebuild_tensor_v2"):
        load_torch_file(tmp_path / "f.pt")
    assert not hasattr(torch._utils._rebuild_tensor_v2, "pwned")


def test_build_on_an_enum_member_a_call_returned_is_refused(tmp_path: Path) -> None:
    """An enum "constructor" returns the one shared member: BUILD on it would change it for the process."""
    raw = (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x01\x85R"
        b"}X\x05\x00\x00\x00pwnedK\x01sb."
    )
    with pytest.raises(BadInput, match="attributes set on"):
        load_torch_file(io.BytesIO(_legacy_bytes(raw_object=raw)))
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    assert not any(hasattr(member, "pwned") for member in _MEM_FORMAT_ENCODING)


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_torch_save_default_protocol_sets_and_slices_load(tmp_path: Path, zip_format: bool) -> None:
    """``torch.save`` writes protocol 2: ``set``/``frozenset``/``slice`` as ``__builtin__.*`` (refused before)."""
    state = {"args": argparse.Namespace(ranks={0, 1}, frozen=frozenset({2}), cut=slice(1, 4, 2)), "w": torch.ones(2)}
    torch.save(state, tmp_path / "f.pt", _use_new_zipfile_serialization=zip_format)
    assert b"__builtin__\nset" in _pickle_of(tmp_path / "f.pt", zip_format)
    loaded = load_torch_file(tmp_path / "f.pt")
    assert (loaded["args"].ranks, loaded["args"].frozen, loaded["args"].cut) == ({0, 1}, frozenset({2}), slice(1, 4, 2))
    assert torch.equal(loaded["w"], torch.ones(2))


def _pickle_of(path: Path, zip_format: bool) -> bytes:
    if not zip_format:
        return path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))


@pytest.mark.parametrize(
    "raw",
    [
        b"\x80\x02ccopy_reg\n_reconstructor\n.",  # protocol 0/1 object rebuilding: calls base.__new__ by name
        b"\x80\x02c__builtin__\neval\n.",
        b"\x80\x02c__builtin__\nreduce\n.",  # renamed to functools.reduce: off the list all the same
    ],
)
def test_protocol_2_names_off_the_list_stay_refused(raw: bytes) -> None:
    with pytest.raises(BadInput, match="refusing to unpickle"):
        load_torch_file(io.BytesIO(_legacy_bytes(raw_object=raw)))


def _call_pickle(call: bytes) -> bytes:
    """``{"x": <call>}`` in protocol-2 opcodes."""
    return b"\x80\x02}X\x01\x00\x00\x00x" + call + b"s."


SHARED = b"]q\x00(h\x00h\x00e"  # l = []; l[:] = [l, l]: a list holding itself twice
ALLOCATIONS = {
    "bytes_of_a_size": b"c__builtin__\nbytes\n\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x01\x85R",
    "bytearray_of_a_size": b"cbuiltins\nbytearray\nJ\x00e\xcd\x1d\x85R",
    "list_of_a_range": b"cbuiltins\nlist\ncbuiltins\nrange\nJ\x00\xe1\xf5\x05\x85R\x85R",
    "str_of_a_container": b"cbuiltins\nstr\n" + SHARED + b"\x85R",
    "hex_encoding": b"c_codecs\nencode\nC\x01xX\x03\x00\x00\x00hex\x86R",
    "ndarray_called": b"cnumpy\nndarray\nJ\x00\xe1\xf5\x05\x85\x85R",
    "reconstruct_by_shape": b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ\x00\xe1\xf5\x05\x85C\x01b\x87R",
    # one 64 KB bytes object memoised, then copied by bytearray() 100 times: 6.4 MB from a 64 KB file
    "memo_copies": b"B\x00\x00\x01\x00"
    + b"\x00" * 65536
    + b"q\x01("
    + b"cbuiltins\nbytearray\nh\x01\x85R" * 100
    + b"l",
}


@pytest.mark.parametrize("call", ALLOCATIONS.values(), ids=ALLOCATIONS.keys())
def test_calls_that_allocate_by_the_files_word_are_refused(call: bytes) -> None:
    with pytest.raises(BadInput, match="no checkpoint writer makes it"):
        load_torch_file(io.BytesIO(_legacy_bytes(raw_object=_call_pickle(call))))
