"""torch's loaders with every pickle through the allow-list (``engine.contract.allow_list``): ``torch.load`` of
rank, RNG and non-tensor DCP files, and DCP's ``.metadata``.

``torch.load`` takes a ``pickle_module`` and uses all of it: its ``Unpickler`` for the object and, in the legacy
(pre-zip) format, its ``load`` for the magic number, protocol version, system info and storage keys around it; so the
module handed over has nothing but the allow-list's ``Unpickler``/``load``/``loads``. The legacy tar format
(torch < 0.4) is refused before torch opens it: it extracts members to disk by name (a member may be a link).
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
import types
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from engine.contract import allow_list
from engine.contract.runfiles import BadInput
from engine.torch_compat import LegacyStorage, set_element


def torch_value(name: str) -> object:
    """``torch.<name>`` where a checkpoint may name it: a dtype, layout, memory format or storage class; else None."""
    obj = getattr(torch, name, None)
    if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
        return obj
    storages = (torch.storage.TypedStorage, torch.storage.UntypedStorage, LegacyStorage)
    if name.endswith("Storage") and isinstance(obj, type) and issubclass(obj, storages):
        return obj
    return None


class TorchUnpickler(allow_list.SafeUnpickler):
    """The allow-list unpickler of a process reading tensors: torch's values on the list resolve."""

    def torch_value(self, name: str) -> object:
        return torch_value(name)


def _pickle_module(path: object, field: str | None) -> types.ModuleType:
    """A ``pickle`` stand-in for ``torch.load(pickle_module=...)``: every stage it reads goes through the allow-list."""
    unpickler = type("Unpickler", (TorchUnpickler,), {"path": path, "field": field})
    mod = types.ModuleType("safe_pickle_module")
    mod.__dict__.update(
        Unpickler=unpickler,
        UnpicklingError=pickle.UnpicklingError,
        load=lambda f, **kw: allow_list.load(f, path, field, TorchUnpickler, **kw),
        loads=lambda data, **kw: allow_list.loads(data, path, field, TorchUnpickler, **kw),
    )
    return mod


def _refuse_tar(source: str | os.PathLike[str] | IO[bytes], name: object, field: str | None) -> None:
    if isinstance(source, (str, os.PathLike)):
        is_tar = tarfile.is_tarfile(source)
    else:
        start = source.tell()
        is_tar = tarfile.is_tarfile(source)
        source.seek(start)
    if is_tar:
        raise BadInput(f"{name}: a torch < 0.4 tar checkpoint (not read: save it again with torch.save)", field=field)


def load_torch_file(  # Any: as torch.load's (whatever the file holds; callers check its shape)
    path: str | os.PathLike[str] | IO[bytes], field: str | None = "load_dir"
) -> Any:
    """``torch.load`` of a file written by someone else, onto the CPU, through the allow-list.

    Refused classes, truncated or corrupt files all raise ``BadInput`` (naming the file and, if refused, the class).
    """
    name = path if isinstance(path, (str, os.PathLike)) else getattr(path, "name", "<bytes>")
    try:
        _refuse_tar(path, name, field)
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_pickle_module(name, field))
    except BadInput:
        raise
    except (
        RuntimeError,
        EOFError,
        pickle.UnpicklingError,
        OSError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        IndexError,
    ) as err:
        raise BadInput(
            f"{name}: not a readable torch checkpoint, truncated? ({type(err).__name__}: {err})", field=field
        ) from err


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read through the allow-list (torch reads it with plain pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:  # Any: FileSystemReader's own signature
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = allow_list.load(cast(IO[bytes], stream), Path(str(path)), "load_dir", TorchUnpickler)
            except BadInput:
                raise
            except (EOFError, pickle.UnpicklingError, ValueError) as err:
                raise BadInput(
                    f"{path}: unreadable checkpoint metadata ({type(err).__name__}: {err})", field="load_dir"
                ) from err
        if not isinstance(metadata, Metadata):
            raise BadInput(f"{path}: not DCP checkpoint metadata ({type(metadata).__name__})", field="load_dir")
        for info in (metadata.storage_data or {}).values():  # the data files DCP opens: beside .metadata only
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
                raise BadInput(f"{path}: names a data file {str(name)[:100]!r} outside its directory", field="load_dir")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items (``BYTE_IO``: step counts, param-group floats) read through the
    allow-list (``DefaultLoadPlanner.load_bytes`` uses ``torch.load(weights_only=False)``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = load_torch_file(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
