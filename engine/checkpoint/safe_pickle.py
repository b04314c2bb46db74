"""Allow-list unpickling for checkpoint files others wrote: Megatron/MindSpeed rank files, DCP RNG and metadata files.

A pickle names callables that run while it loads, so a file dropped in a data root could run code as the worker.
torch's ``weights_only=True`` refuses too much for these files (``argparse.Namespace``, Megatron's enums, NumPy RNG
states, DCP's metadata dataclasses) and ``add_safe_globals`` would admit the real Megatron classes only where
megatron is installed; so the allow-list lives here, in one ``find_class``: exactly the globals a real Megatron /
MindSpeed / DCP file holds. Megatron's enums load as inert stand-ins (never imported, the same on every host).
Anything else is refused with a ``BadInput`` naming the class, before any of it runs.
"""

from __future__ import annotations

import io
import os
import pickle
import types
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from engine.runfiles import BadInput
from engine.torch_compat import LegacyStorage, set_element

# Plain constructors and torch's own tensor rebuilders: they build data and call nothing named by the file.
_PLAIN: dict[str, set[str]] = {
    "builtins": {
        "set",
        "frozenset",
        "complex",
        "slice",
        "range",
        "bytearray",
        "bytes",
        "dict",
        "list",
        "tuple",
        "int",
        "float",
        "str",
        "bool",
    },
    "collections": {"OrderedDict", "defaultdict", "deque"},
    "_codecs": {"encode"},
    "argparse": {"Namespace"},
    "types": {"SimpleNamespace"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "torch": {"Size", "device"},
    "torch._utils": {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_parameter_with_state"},
    "torch._tensor": {"_rebuild_from_type_v2"},
    "torch.nn.parameter": {"Parameter"},
    "torch.serialization": {"_get_layout"},
    "numpy": {"ndarray", "dtype"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    # torch.distributed.checkpoint's .metadata file
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
}

# The enums Megatron-LM / Megatron-Core / MindSpeed pickle inside ``args`` (attention_backend, model_type,
# fp8/fp4 recipes, cuda_graph_scope) and the rerun state machine's state; megatron.legacy / megatron.model are the
# older homes of the same enums.
_MEGATRON_ENUMS: dict[str, set[str]] = {
    "megatron.core.enums": {"ModelType", "Fp8Recipe", "Fp4Recipe"},
    "megatron.core.transformer.enums": {
        "ModelType",
        "LayerType",
        "AttnType",
        "AttnMaskType",
        "AttnBackend",
        "CudaGraphScope",
    },
    "megatron.core.rerun_state_machine": {"RerunMode", "RerunState", "RerunDiagnostic", "RerunValidationStatus"},
    "megatron.legacy.model.enums": {"LayerType", "AttnType", "AttnMaskType"},
    "megatron.model.enums": {"LayerType", "AttnType", "AttnMaskType", "ModelType"},
}


class PickledEnum:
    """An inert stand-in for a Megatron enum member: keeps the pickled value, runs nothing."""

    def __init__(self, value: Any = None, *rest: Any) -> None:
        self.value = value

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}({self.value!r})"


_STANDINS: dict[tuple[str, str], type] = {
    (module, name): type(name, (PickledEnum,), {"__module__": module})
    for module, names in _MEGATRON_ENUMS.items()
    for name in names
}


def allowed_global(module: str, name: str, path: object = "", field: str | None = "load_dir") -> Any:
    """The object ``module.name`` may stand for in a checkpoint pickle; ``BadInput`` naming it otherwise."""
    if name in _PLAIN.get(module, ()):
        return getattr(__import__(module, fromlist=[name]), name)
    if (module, name) in _STANDINS:
        return _STANDINS[module, name]
    if module == "torch":
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        if (
            name.endswith("Storage")
            and isinstance(obj, type)
            and issubclass(obj, (torch.storage.TypedStorage, torch.storage.UntypedStorage, LegacyStorage))
        ):
            return obj
    where = f"{path}: " if path else ""
    raise BadInput(
        f"{where}refusing to unpickle {module}.{name}: not a class a Megatron/MindSpeed or DCP "
        "checkpoint holds (only tensors, containers, argparse.Namespace and Megatron's enums are "
        "loaded)",
        field=field,
    )


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` resolving globals through ``allowed_global`` only (INST/OBJ/GLOBAL all pass here)."""

    path: object = ""
    field: str | None = "load_dir"

    def find_class(self, module: str, name: str) -> Any:
        return allowed_global(module, name, self.path, self.field)


def _pickle_module(path: object, field: str | None) -> types.ModuleType:
    """A ``pickle`` look-alike for ``torch.load(pickle_module=...)`` whose Unpickler is the safe one."""
    mod = types.ModuleType("safe_pickle_module")
    mod.__dict__.update({k: v for k, v in pickle.__dict__.items() if not k.startswith("__")})
    mod.Unpickler = type("Unpickler", (SafeUnpickler,), {"path": path, "field": field})  # type: ignore[attr-defined]
    return mod


def load_torch_file(path: str | os.PathLike[str] | IO[bytes], field: str | None = "load_dir") -> Any:
    """``torch.load`` of a file written by someone else, onto the CPU, through the allow-list.

    Refused classes, truncated or corrupt files all raise ``BadInput`` (naming the file and, if refused, the class).
    """
    name = path if isinstance(path, (str, os.PathLike)) else getattr(path, "name", "<bytes>")
    try:
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

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            unpickler = SafeUnpickler(stream)
            unpickler.path = Path(str(path))
            try:
                metadata = unpickler.load()
            except BadInput:
                raise
            except (EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError) as err:
                raise BadInput(
                    f"{path}: unreadable checkpoint metadata ({type(err).__name__}: {err})", field="load_dir"
                ) from err
        if not isinstance(metadata, Metadata):
            raise BadInput(f"{path}: not DCP checkpoint metadata ({type(metadata).__name__})", field="load_dir")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items (``BYTE_IO``: step counts, param-group floats) read through the
    allow-list (``DefaultLoadPlanner.load_bytes`` uses ``torch.load(weights_only=False)``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = load_torch_file(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
