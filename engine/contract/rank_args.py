"""A Megatron rank file's ``args``, read for the API in a child process under a byte, time and memory budget.

The API reads a rank file's ``data.pkl`` at submission for the model shape (``engine.contract.plan.shape``). A pickle
needs no code to hurt its reader: a 1 MB run of ``TUPLE1`` opcodes used as a dict key overflows the C stack when
hashed (a segfault, not an exception), a tuple of shared tuples hashes for ever, a few bytes of opcodes build objects
fifty times their size. So the API never unpickles one itself: a child process does, through the allow-list with
every torch/NumPy global inert, with its address space, CPU time and file writes limited, and stops as soon as
``args`` is read (Megatron and ``engine.checkpoint.megatron_write`` write it first, a few KB into the file). It sends
back only the shape fields, as JSON scalars; the parent kills it past ``TIMEOUT_S``.

``read_rank_args`` (parent side) returns those fields, None when the file holds no ``args`` (not a zip, no
``data.pkl``), and raises ``BadInput`` naming ``field`` when the file cannot be read within the limits or is refused.
Run as ``python -m engine.contract.rank_args FILE`` it is the child.
"""

from __future__ import annotations

import argparse
import functools
import json
import pickle
import resource
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from engine.contract.allow_list import TORCH_FAMILY, SafeUnpickler, on_list, refuse
from engine.contract.runfiles import BadInput

# The args the shape is read from (engine.contract.plan.shape, model_config.moe_from_args, rope_scaling.from_args).
SHAPE_ARGS = (
    "num_layers",
    "hidden_size",
    "max_position_embeddings",
    "num_attention_heads",
    "padded_vocab_size",
    "vocab_size",
    "ffn_hidden_size",
    "swiglu",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "untie_embeddings_and_output_weights",
    "num_experts",
    "num_local_experts",
    "moe_router_topk",
    "num_experts_per_tok",
    "moe_ffn_hidden_size",
    "moe_intermediate_size",
    "moe_aux_loss_coeff",
    "router_aux_loss_coef",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
    "rope_scaling_type",
    "rope_scaling_factor",
    "rope_scaling_original_max_position_embeddings",
    "rope_scaling_beta_fast",
    "rope_scaling_beta_slow",
    "rope_scaling_mscale",
    "rope_scaling_mscale_all_dim",
    "rope_scaling_attention_factor",
)
MAX_PICKLE_BYTES = 16 << 20  # of data.pkl read before args must be whole (a real file's are in its first KBs)
MEMORY_BYTES = 512 << 20  # the child's address space
TIMEOUT_S = 10.0  # the child's wall clock (its CPU limit too)
_MAX_LIST = 4096  # entries of a list field sent back (mlp_only_layers: at most one per layer)
_MAX_TEXT = 200  # characters of a text field or an error sent back


class _Inert:
    """What only torch builds (tensors, storages, dtypes, NumPy arrays): takes anything, builds nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Inert:
        return _Inert()

    def __setstate__(self, state: object) -> None:
        pass


class _ArgsFound(Exception):
    """Raised from the read hook once ``args`` is whole: the rest of the file is not read."""


class ArgsUnpickler(SafeUnpickler):
    """A rank file's pickle through the allow-list, without torch: what only torch builds becomes ``_Inert``;
    anything off the list is refused as the engine refuses it. Stops at ``args`` and past ``MAX_PICKLE_BYTES`` or the
    deadline (checked on every read: the pure-Python unpickler reads each opcode of a protocol-2 stream)."""

    metastack: list[list[Any]]

    def __init__(self, file: IO[bytes], deadline: float, **kwargs: Any) -> None:  # Any: pickle.Unpickler's options
        super().__init__(file, **kwargs)
        self.deadline = deadline
        read, readline = self._file_read, self._file_readline

        def budget_read(n: int = -1) -> bytes:
            return self._budget(read, n)

        def budget_readline(size: int = -1) -> bytes:
            return self._budget(readline, size)

        self._file_read, self._file_readline = budget_read, budget_readline

    def _budget(self, read: Callable[..., bytes], n: int) -> bytes:
        """One read of the stream, never past ``MAX_PICKLE_BYTES`` in all (a frame's length is the file's word)."""
        if self._args_whole():
            raise _ArgsFound
        left = MAX_PICKLE_BYTES - self.bytes_read
        if left <= 0:
            raise BadInput(f"{self.path}: data.pkl gives no whole args within {MAX_PICKLE_BYTES} bytes", self.field)
        if time.monotonic() > self.deadline:
            raise BadInput(f"{self.path}: data.pkl gives no whole args within {TIMEOUT_S:.0f} s", self.field)
        data: bytes = read(left if n < 0 else min(n, left))
        return data

    def _args_whole(self) -> bool:
        """The top-level dict's items so far are ``"args"``, a Namespace, and the next key: args is complete."""
        meta, stack = getattr(self, "metastack", None), self.stack
        return (
            meta is not None
            and len(meta) == 1
            and len(stack) >= 3
            and type(stack[0]) is str
            and stack[0] == "args"
            and isinstance(stack[1], argparse.Namespace)
            and type(stack[2]) is str
        )

    def args(self) -> Any:  # Any: Megatron's args namespace as pickled (its fields are read by name)
        """The ``args`` of the file: read up to its end, or up to the moment ``args`` is whole."""
        try:
            obj = self.load()
        except _ArgsFound:
            return self.stack[1]
        return obj.get("args") if isinstance(obj, dict) else None

    def persistent_load(self, pid: object) -> None:
        return None

    def find_class(self, module: str, name: str) -> Any:  # Any: as pickle.Unpickler's (a global the stream names)
        module, name = self.python3_name(module, name)
        if module.split(".")[0] in TORCH_FAMILY:
            if not on_list(module, name):
                raise refuse(f"{module}.{name}", self.path, self.field)
            return _Inert
        return super().find_class(module, name)


def _sendable(value: object) -> object:
    """A field's value as JSON the parent validates; what is not a scalar is named by its type."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value[:_MAX_TEXT]
    if isinstance(value, (list, tuple)) and len(value) <= _MAX_LIST and all(type(v) is int for v in value):
        return list(value)
    return {"unreadable": type(value).__name__[:_MAX_TEXT]}


def _shape_fields(args: object) -> dict[str, Any] | None:
    if not isinstance(args, argparse.Namespace):
        return None
    given = vars(args)
    return {name: _sendable(given[name]) for name in SHAPE_ARGS if name in given}


def _read(path: Path, deadline: float) -> dict[str, Any] | None:
    if not zipfile.is_zipfile(path):
        return None  # the legacy format: only the engine reads it (with torch)
    with zipfile.ZipFile(path) as zf:
        info = next((i for i in zf.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"), None)
        if info is None:
            return None
        with zf.open(info) as stream:
            unpickler = ArgsUnpickler(stream, deadline)
            unpickler.path = path
            return _shape_fields(unpickler.args())


def _limit_self() -> None:
    for limit, value in (
        (resource.RLIMIT_AS, MEMORY_BYTES),
        (resource.RLIMIT_CPU, int(TIMEOUT_S) + 1),
        (resource.RLIMIT_FSIZE, 0),  # writes nothing
        (resource.RLIMIT_CORE, 0),
    ):
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


def _child(path: str) -> int:
    _limit_self()
    try:
        out: dict[str, Any] = {"args": _read(Path(path), time.monotonic() + TIMEOUT_S)}
    except BadInput as err:
        out = {"refused": str(err)[: _MAX_TEXT * 5]}
    except (OSError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, RecursionError) as err:
        out = {"refused": f"{path}: not a readable torch checkpoint ({type(err).__name__}: {str(err)[:_MAX_TEXT]})"}
    except MemoryError:
        out = {"refused": f"{path}: data.pkl needs more than {MEMORY_BYTES >> 20} MiB to read"}
    sys.stdout.write(json.dumps(out))
    return 0


def _why_failed(proc: subprocess.CompletedProcess[str]) -> str:
    if proc.returncode < 0:
        return f"its reader was killed by signal {-proc.returncode} (a pickle built to crash its reader?)"
    return f"its reader exited with {proc.returncode}"


def read_rank_args(path: Path, field: str = "load") -> dict[str, Any] | None:
    """The shape fields of ``path``'s ``args`` (JSON scalars, unvalidated), read by a limited child process."""
    st = path.stat()
    return _read_cached(str(path), st.st_ino, st.st_size, st.st_mtime_ns, field)


@functools.lru_cache(maxsize=64)  # admission and the memory plan read the same file at one submission
def _read_cached(path: str, ino: int, size: int, mtime_ns: int, field: str) -> dict[str, Any] | None:
    where = f"{path}: the Megatron args (the model shape)"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", __name__, path],
            cwd=Path(__file__).resolve().parents[2],  # the repository root: ``engine`` importable without a site
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            timeout=TIMEOUT_S + 5,  # + the child's start
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise BadInput(f"{where} could not be read within {TIMEOUT_S:.0f} s", field=field) from None
    try:
        out = json.loads(proc.stdout) if proc.returncode == 0 else None
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict):
        raise BadInput(f"{where} could not be read: {_why_failed(proc)}", field=field)
    if "refused" in out:
        raise BadInput(str(out["refused"]), field=field)
    args = out.get("args")
    return args if isinstance(args, dict) else None


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
