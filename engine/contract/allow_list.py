"""The one allow-list for unpickling files others wrote (Megatron/MindSpeed rank files, DCP files), torch-free.

A pickle names callables that run while it loads, so a file dropped in a data root could run code as the worker.
torch's ``weights_only=True`` refuses too much for these files (``argparse.Namespace``, Megatron's enums, NumPy RNG
states, DCP's metadata dataclasses) and ``add_safe_globals`` would admit the real Megatron classes only where
megatron is installed; so the allow-list lives here, in one ``find_class``: exactly the globals a real Megatron /
MindSpeed / DCP file holds. Megatron's enums load as inert stand-ins (never imported, the same on every host).
Anything else is refused with a ``BadInput`` naming the class, before any of it runs.

``SafeUnpickler`` is the pure-Python unpickler (``pickle._Unpickler``) so that two opcodes can be checked too:
``BUILD`` on a class (which would set attributes of an allowed class for the whole process) and a persistent id
other than a storage (torch's legacy "module" ids make it compare, and may write a ``.patch`` of, class sources).
This module imports no torch: the API reads a rank file's ``args`` through it (``engine.contract.plan.shape``) with
every torch and NumPy global made inert; the engine's loaders use ``engine.checkpoint.safe_pickle.TorchUnpickler``,
which resolves torch's dtypes and storage classes (it overrides ``SafeUnpickler.torch_value``).
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable
from typing import IO, Any, ClassVar

from engine.contract.runfiles import BadInput

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

# Modules whose globals only a torch process resolves (the API builds them as inert stand-ins).
TORCH_FAMILY = ("torch", "numpy")


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


def refuse(what: str, path: object, field: str | None) -> BadInput:
    """The error for a pickle that names something off the list."""
    where = f"{path}: " if path else ""
    return BadInput(
        f"{where}refusing to unpickle {what}: not a class a Megatron/MindSpeed or DCP "
        "checkpoint holds (only tensors, containers, argparse.Namespace and Megatron's enums are "
        "loaded)",
        field=field,
    )


def on_list(module: str, name: str) -> bool:
    """Whether ``module.name`` is on the list by name. ``torch`` values (dtypes, layouts, memory formats, typed
    storages) are told apart by what they are, which ``allowed_global`` checks where torch is loaded."""
    return name in _PLAIN.get(module, ()) or (module, name) in _STANDINS or (module == "torch" and name.isidentifier())


TorchValue = Callable[[str], Any]  # torch.<name> -> the dtype/layout/storage class it names, or None


def allowed_global(
    module: str, name: str, path: object = "", field: str | None = "load_dir", torch_value: TorchValue | None = None
) -> Any:
    """The object ``module.name`` may stand for in a checkpoint pickle; ``BadInput`` naming it otherwise. ``torch``
    values resolve only through ``torch_value``, which a process reading tensors supplies
    (``engine.checkpoint.safe_pickle.torch_value``); without it they are refused."""
    if name in _PLAIN.get(module, ()):
        return getattr(__import__(module, fromlist=[name]), name)
    if (module, name) in _STANDINS:
        return _STANDINS[module, name]
    obj = torch_value(name) if module == "torch" and on_list(module, name) and torch_value is not None else None
    if obj is None:
        raise refuse(f"{module}.{name}", path, field)
    return obj


def _storage_id(pid: Any) -> bool:
    """A tensor storage's persistent id: ``("storage", ...)`` (zip and legacy formats), never a "module" id."""
    return not isinstance(pid, tuple) or (bool(pid) and pid[0] in ("storage", b"storage"))


_PY_DISPATCH: dict[int, Callable[[Any], None]] = pickle._Unpickler.dispatch  # opcode -> handler


class SafeUnpickler(pickle._Unpickler):
    """The pure-Python unpickler resolving globals through ``allowed_global`` only (INST/OBJ/GLOBAL/STACK_GLOBAL all
    pass ``find_class``); ``BUILD`` on a class and non-storage persistent ids are refused."""

    path: object = ""
    field: str | None = "load_dir"
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(_PY_DISPATCH)
    stack: list[Any]  # the Python unpickler's stack (undeclared in its stubs)

    def find_class(self, module: str, name: str) -> Any:
        return allowed_global(module, name, self.path, self.field, self.torch_value)

    def torch_value(self, name: str) -> Any:
        """``torch.<name>`` on the list; None here (torch-free), resolved by the torch-reading subclass."""
        return None

    def load(self) -> Any:
        """As ``pickle.Unpickler.load``; a malformed stream raises ``UnpicklingError`` as the C unpickler's does
        (the Python one lets an unknown opcode's ``KeyError`` or an empty stack's ``IndexError`` out)."""
        try:
            return super().load()
        except (KeyError, IndexError, TypeError, AttributeError, struct.error, AssertionError) as err:
            raise pickle.UnpicklingError(f"malformed pickle ({type(err).__name__}: {err})") from err

    def _build(self) -> None:
        target = self.stack[-2]
        if isinstance(target, type):
            what = f"attributes set on the class {target.__module__}.{target.__qualname__}"
            raise refuse(what, self.path, self.field)
        _PY_DISPATCH[pickle.BUILD[0]](self)

    def _binpersid(self) -> None:
        if not _storage_id(self.stack[-1]):
            raise refuse(f"the persistent id {self.stack[-1]!r:.80}", self.path, self.field)
        _PY_DISPATCH[pickle.BINPERSID[0]](self)


SafeUnpickler.dispatch[pickle.BUILD[0]] = SafeUnpickler._build
SafeUnpickler.dispatch[pickle.BINPERSID[0]] = SafeUnpickler._binpersid


def load(
    file: IO[bytes],
    path: object = "",
    field: str | None = "load_dir",
    unpickler_class: type[SafeUnpickler] = SafeUnpickler,
    **kwargs: Any,
) -> Any:
    """``pickle.load`` through the allow-list."""
    unpickler = unpickler_class(file, **kwargs)
    unpickler.path, unpickler.field = path, field
    return unpickler.load()


def loads(
    data: bytes,
    path: object = "",
    field: str | None = "load_dir",
    unpickler_class: type[SafeUnpickler] = SafeUnpickler,
    **kwargs: Any,
) -> Any:
    """``pickle.loads`` through the allow-list."""
    return load(io.BytesIO(data), path, field, unpickler_class, **kwargs)
