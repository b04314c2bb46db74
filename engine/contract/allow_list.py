"""The one allow-list for unpickling files others wrote (Megatron/MindSpeed rank files, DCP files), torch-free.

A pickle names callables that run while it loads, so a file dropped in a data root could run code as the worker.
torch's ``weights_only=True`` refuses too much for these files (``argparse.Namespace``, Megatron's enums, NumPy RNG
states, DCP's metadata dataclasses) and ``add_safe_globals`` would admit the real Megatron classes only where
megatron is installed; so the allow-list lives here, in one ``find_class``: exactly the globals a real Megatron /
MindSpeed / DCP file holds. Megatron's enums load as inert stand-ins (never imported, the same on every host).
Anything else is refused with a ``BadInput`` naming the class, before any of it runs.

``SafeUnpickler`` is the pure-Python unpickler (``pickle._Unpickler``) so that opcodes can be checked too:

- ``BUILD`` (set attributes) only on an object a call of this load made (never on a global the file named: a class,
  an allowed torch function such as ``_rebuild_tensor_v2``, an enum member), which would change it for the process;
- a persistent id other than a storage (torch's legacy "module" ids make it compare, and may write a ``.patch`` of,
  class sources) is refused;
- every call (``REDUCE``, ``NEWOBJ``, ``INST``/``OBJ``) is checked before it runs (``_check_call``): nothing on the
  list may allocate by a size the file gives (``bytes(2**56)``, ``bytearray(n)``, an ndarray's shape), expand a
  ``range``, turn a container into text (``str`` of a shared list grows exponentially) or re-encode but to Latin-1,
  and all calls of one load together may build no more items than the bytes the load has read (a real pickle
  spends bytes on every item it passes; a hostile one copies one memoised object again and again).

Protocol 0-2 pickles name Python 2 modules (``__builtin__.set``: what ``torch.save``'s default protocol writes) and
are renamed as ``pickle`` itself renames them (``_compat_pickle``) before the list is consulted.
This module imports no torch: the API reads a rank file's ``args`` through it (``engine.contract.plan.shape``) with
every torch and NumPy global made inert; the engine's loaders use ``engine.checkpoint.safe_pickle.TorchUnpickler``,
which resolves torch's dtypes and storage classes (it overrides ``SafeUnpickler.torch_value``).
"""

from __future__ import annotations

import _compat_pickle
import collections
import enum
import io
import math
import pickle
import struct
from collections.abc import Callable, Iterable
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

    def __init__(self, value: object = None, *rest: object) -> None:
        self.value = value

    def __setstate__(self, state: object) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}({self.value!r})"


_STANDINS: dict[tuple[str, str], type] = {
    (module, name): type(name, (PickledEnum,), {"__module__": module})
    for module, names in _MEGATRON_ENUMS.items()
    for name in names
}


_OFF_LIST = (
    "not a class a Megatron/MindSpeed or DCP checkpoint holds (only tensors, containers, argparse.Namespace and "
    "Megatron's enums are loaded)"
)
_NEVER_WRITTEN = "no checkpoint writer makes it (the allow-list's limits on calls and BUILD)"


def refuse(what: str, path: object, field: str | None, why: str = _OFF_LIST) -> BadInput:
    """The error for a pickle that names something off the list (or, with ``why``, does what no writer does)."""
    where = f"{path}: " if path else ""
    return BadInput(f"{where}refusing to unpickle {what}: {why}", field=field)


def on_list(module: str, name: str) -> bool:
    """Whether ``module.name`` is on the list by name. ``torch`` values (dtypes, layouts, memory formats, typed
    storages) are told apart by what they are, which ``allowed_global`` checks where torch is loaded."""
    return name in _PLAIN.get(module, ()) or (module, name) in _STANDINS or (module == "torch" and name.isidentifier())


TorchValue = Callable[[str], Any]  # torch.<name> -> the dtype/layout/storage class it names, or None


def allowed_global(
    module: str, name: str, path: object = "", field: str | None = "load_dir", torch_value: TorchValue | None = None
) -> Any:  # Any: the global itself (a class or function the stream names), as find_class returns it
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


def _storage_id(pid: object) -> bool:
    """A tensor storage's persistent id: ``("storage", ...)`` (zip and legacy formats), never a "module" id."""
    return not isinstance(pid, tuple) or (bool(pid) and pid[0] in ("storage", b"storage"))


_PY_DISPATCH: dict[int, Callable[[Any], None]] = pickle._Unpickler.dispatch  # opcode -> handler

# What a call may be given whole: concrete values the stream spelled out (never a size, a range or an iterator).
_CONCRETE = (str, bytes, bytearray, list, tuple, dict, set, frozenset, collections.deque)
_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None))
_LATIN1 = ("latin1", "latin-1", "iso-8859-1")  # what protocol 2 writes bytes with: ``_codecs.encode(s, "latin1")``
_TENSOR_REBUILDERS = ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_parameter_with_state")
# Items every load may build beyond the bytes it has read (the small lists a real file's headers make).
BUILD_SLACK = 1 << 16


def _name_of(func: object) -> tuple[str, str]:
    return getattr(func, "__module__", None) or "", getattr(func, "__name__", None) or type(func).__name__


def _items(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The items a call copies out of its arguments (what it may allocate beyond what it was given)."""
    values = (*args, *kwargs.values())
    return sum(len(v) for v in values if isinstance(v, _CONCRETE))


def _why_refused(func: object, args: tuple[object, ...], kwargs: dict[str, object]) -> str | None:
    """Why ``func(*args, **kwargs)`` may not run in a load; None when it may."""
    values = (*args, *kwargs.values())
    module, name = _name_of(func)
    if any(isinstance(v, range) for v in values):
        return "a range expanded by a call (the file gives its length)"
    if func in (bytes, bytearray) and values and not isinstance(values[0], _CONCRETE):
        return f"{name}() of {type(values[0]).__name__} (allocates by a size taken from the file)"
    if func is str and any(not isinstance(v, _SCALARS) for v in values):
        return "str() of a container (its text grows with every shared reference)"
    if module == "_codecs" and (len(args) > 1 and str(args[1]).lower() not in _LATIN1 or len(args) > 2 or kwargs):
        return f"_codecs.encode to {str(args[1])[:40]!r} (only Latin-1, as protocol 2 writes bytes)"
    if module.split(".")[0] == "numpy" and name == "ndarray":
        return "numpy.ndarray() called (allocates by a shape taken from the file)"
    if name == "_reconstruct" and len(args) > 1 and _numel(args[1]) != 0:
        return "numpy _reconstruct of a non-empty shape (NumPy writes (0,) and the data in its state)"
    if name == "_rebuild_from_type_v2" and args:
        inner = args[0]
        if _name_of(inner)[1] not in _TENSOR_REBUILDERS:
            return f"_rebuild_from_type_v2 calling {'.'.join(_name_of(inner))} (only the tensor rebuilders)"
        if len(args) > 2 and isinstance(args[2], tuple):
            return _why_refused(inner, args[2], {})
    return None


def _numel(shape: object) -> int | None:
    if isinstance(shape, int):
        return shape
    if isinstance(shape, tuple) and all(isinstance(d, int) for d in shape):
        return math.prod(shape)
    return None


def python3_name(module: str, name: str) -> tuple[str, str]:
    """A protocol 0-2 pickle's Python 2 name as Python 3 resolves it (``__builtin__.set`` -> ``builtins.set``), the
    mapping ``pickle``'s own ``find_class`` applies; the result still has to be on the list."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        mapped: tuple[str, str] = _compat_pickle.NAME_MAPPING[module, name]
        return mapped
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class SafeUnpickler(pickle._Unpickler):
    """The pure-Python unpickler resolving globals through ``allowed_global`` only (INST/OBJ/GLOBAL/STACK_GLOBAL all
    pass ``find_class``); calls are checked before they run, ``BUILD`` is only allowed on what a call of this load
    made, non-storage persistent ids are refused."""

    path: object = ""
    field: str | None = "load_dir"
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(_PY_DISPATCH)
    stack: list[Any]  # the Python unpickler's stack (undeclared in its stubs)
    proto: int
    fix_imports: bool

    def __init__(self, file: IO[bytes], **kwargs: Any) -> None:  # Any: pickle.Unpickler's keyword options
        super().__init__(file, **kwargs)
        self.bytes_read = 0
        self.items_built = 0
        self._made: dict[int, Any] = {}  # id -> object, for every object a call of this load returned
        read, readline = file.read, file.readline

        def counted_read(n: int = -1) -> bytes:
            data = read(n)
            self.bytes_read += len(data)
            return data

        def counted_readline(size: int = -1) -> bytes:
            line = readline(size)
            self.bytes_read += len(line)
            return line

        self._file_read, self._file_readline = counted_read, counted_readline

    def python3_name(self, module: str, name: str) -> tuple[str, str]:
        """``module.name`` as ``pickle`` would resolve it (Python 2 names in protocol 0-2 pickles renamed)."""
        return python3_name(module, name) if self.proto < 3 and self.fix_imports else (module, name)

    def find_class(self, module: str, name: str) -> Any:  # Any: as pickle.Unpickler's (a global the stream names)
        module, name = self.python3_name(module, name)
        return allowed_global(module, name, self.path, self.field, self.torch_value)

    def torch_value(self, name: str) -> object:
        """``torch.<name>`` on the list; None here (torch-free), resolved by the torch-reading subclass."""
        return None

    def load(self) -> Any:  # Any: as pickle.Unpickler's (whatever the file holds)
        """As ``pickle.Unpickler.load``; a malformed stream raises ``UnpicklingError`` as the C unpickler's does
        (the Python one lets an unknown opcode's ``KeyError`` or an empty stack's ``IndexError`` out)."""
        try:
            return super().load()
        except (KeyError, IndexError, TypeError, AttributeError, struct.error, AssertionError) as err:
            raise pickle.UnpicklingError(f"malformed pickle ({type(err).__name__}: {err})") from err

    def _check_call(self, func: object, args: object, kwargs: object = None) -> None:
        args = args if isinstance(args, tuple) else ()
        kwargs = kwargs if isinstance(kwargs, dict) else {}
        why = _why_refused(func, args, kwargs)
        self.items_built += _items(args, kwargs)
        if why is None and self.items_built > self.bytes_read + BUILD_SLACK:
            why = f"calls building {self.items_built} items from {self.bytes_read} bytes (one object copied again)"
        if why is not None:
            raise refuse(why, self.path, self.field, _NEVER_WRITTEN)

    def _made_by_call(self) -> None:
        self._made[id(self.stack[-1])] = self.stack[-1]

    def _reduce(self) -> None:
        self._check_call(self.stack[-2], self.stack[-1])
        _PY_DISPATCH[pickle.REDUCE[0]](self)
        self._made_by_call()

    def _newobj(self) -> None:
        self._check_call(self.stack[-2], self.stack[-1])
        _PY_DISPATCH[pickle.NEWOBJ[0]](self)
        self._made_by_call()

    def _newobj_ex(self) -> None:
        self._check_call(self.stack[-3], self.stack[-2], self.stack[-1])
        _PY_DISPATCH[pickle.NEWOBJ_EX[0]](self)
        self._made_by_call()

    def _instantiate(self, klass: object, args: Iterable[object]) -> None:  # INST and OBJ
        self._check_call(klass, tuple(args))
        super()._instantiate(klass, args)  # type: ignore[misc]
        self._made_by_call()

    def _build(self) -> None:
        target = self.stack[-2]
        if isinstance(target, type):
            what = f"attributes set on the class {target.__module__}.{target.__qualname__}"
            raise refuse(what, self.path, self.field)
        if self._made.get(id(target)) is not target or isinstance(target, enum.Enum):
            # a global the file named (a torch function, a module, an enum member): BUILD would change it for
            # every later user in this process
            module, name = _name_of(target)
            what = f"attributes set on {module}.{name} (not an object this file made)"
            raise refuse(what, self.path, self.field, _NEVER_WRITTEN)
        _PY_DISPATCH[pickle.BUILD[0]](self)

    def _binpersid(self) -> None:
        if not _storage_id(self.stack[-1]):
            raise refuse(f"the persistent id {self.stack[-1]!r:.80}", self.path, self.field)
        _PY_DISPATCH[pickle.BINPERSID[0]](self)


SafeUnpickler.dispatch.update(
    {
        pickle.BUILD[0]: SafeUnpickler._build,
        pickle.BINPERSID[0]: SafeUnpickler._binpersid,
        pickle.REDUCE[0]: SafeUnpickler._reduce,
        pickle.NEWOBJ[0]: SafeUnpickler._newobj,
        pickle.NEWOBJ_EX[0]: SafeUnpickler._newobj_ex,
    }
)


def load(
    file: IO[bytes],
    path: object = "",
    field: str | None = "load_dir",
    unpickler_class: type[SafeUnpickler] = SafeUnpickler,
    **kwargs: Any,  # pickle.Unpickler's keyword options
) -> Any:  # Any: as pickle.load's (whatever the file holds; callers check its shape)
    """``pickle.load`` through the allow-list."""
    unpickler = unpickler_class(file, **kwargs)
    unpickler.path, unpickler.field = path, field
    return unpickler.load()


def loads(
    data: bytes,
    path: object = "",
    field: str | None = "load_dir",
    unpickler_class: type[SafeUnpickler] = SafeUnpickler,
    **kwargs: Any,  # pickle.Unpickler's keyword options
) -> Any:  # Any: as pickle.loads's
    """``pickle.loads`` through the allow-list."""
    return load(io.BytesIO(data), path, field, unpickler_class, **kwargs)
