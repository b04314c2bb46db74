"""Lazy tensor readers for safetensors and ``torch.save`` zip files: ``pread`` of exactly the bytes asked for.

Both formats store each tensor's bytes contiguously at a known offset (safetensors: its JSON header;
``torch.save``: an uncompressed zip record per storage), so a tensor, or a run of its rows for one TP rank, is read
with one ``os.preadv`` straight into its destination (e.g. the rows of a fused ``linear_qkv`` shard). Memory-mapping
would read the same pages but leave every touched page of the source resident in the process (peak RSS ≈ the
whole input); ``pread`` keeps only what the converter holds. Opening a file reads headers and the pickle only.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint.safe_pickle import TorchUnpickler
from engine.contract.runfiles import BadInput
from engine.dtypes import SAFETENSORS_DTYPES


def _pread_into(fd: int, out: torch.Tensor, offset: int, path: Path, what: str) -> torch.Tensor:
    view = out.reshape(-1).view(torch.uint8).numpy().data if out.numel() else memoryview(b"")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise BadInput(
                f"{path}: tensor {what} is cut short at byte {offset + done} (truncated file?)", field="load_dir"
            )
        done += n
    return out


def read_segment_into(fd: int, out: torch.Tensor, offset: int, what: str) -> torch.Tensor:
    """Bytes ``offset:offset + out.nbytes`` of the open file ``fd`` straight into ``out`` (contiguous)."""
    return _pread_into(fd, out, offset, Path(f"/proc/self/fd/{fd}"), what)


class TensorRef:
    """A tensor stored contiguously at ``offset`` of an open file; read on demand."""

    def __init__(self, file: _File, name: str, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.file, self.name, self.offset, self.shape, self.dtype = file, name, offset, tuple(shape), dtype
        self.row_bytes = int(torch.Size(self.shape[1:]).numel()) * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return (self.shape[0] if self.shape else 1) * self.row_bytes

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        if not self.shape:
            return self.read_rows(0, 1, None).reshape(())
        return self.read_rows(0, self.shape[0], out)

    def read_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0), into ``out`` (contiguous, right shape and dtype) when given."""
        shape = (stop - start, *self.shape[1:])
        if out is None:
            out = torch.empty(shape, dtype=self.dtype)
        elif tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"{self.name}: cannot read rows {start}:{stop} into {tuple(out.shape)} {out.dtype}")
        return _pread_into(self.file.fd, out, self.offset + start * self.row_bytes, self.file.path, self.name)

    def read_cols(self, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` of a 2-D tensor: one ``preadv`` per 512 rows scatters each row's wanted bytes
        into place and the rest into a scratch buffer, so no strided copy is made in user space."""
        rows, cols = self.shape
        elem = torch.empty((), dtype=self.dtype).element_size()
        out = torch.empty((rows, stop - start), dtype=self.dtype)
        seg, gap = (stop - start) * elem, (cols - (stop - start)) * elem
        dest = out.reshape(-1).view(torch.uint8).numpy().data
        scratch = memoryview(bytearray(gap))
        for first in range(0, rows, 512):  # IOV_MAX is 1024 buffers
            last = min(first + 512, rows)
            iov = []
            for r in range(first, last):
                iov.append(dest[r * seg : (r + 1) * seg])
                if r < last - 1 and gap:
                    iov.append(scratch)
            offset = self.offset + first * cols * elem + start * elem
            want = (last - first) * seg + (last - first - 1) * gap
            if os.preadv(self.file.fd, iov, offset) != want:
                raise BadInput(f"{self.file.path}: tensor {self.name} is cut short (truncated file?)", field="load_dir")
        return out


class _File:
    def __init__(self, path: Path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            raise BadInput(f"{path}: cannot open ({err.strerror})", field="load_dir") from err
        self.size = os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class SafetensorsFile(_File):
    """The tensors of one ``.safetensors`` file, checked against the file size (a truncated file is named)."""

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(Path(path))
        head = os.pread(self.fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 0 or 8 + n > self.size:
            raise BadInput(f"{self.path}: not a safetensors file, or truncated (header cut short)", field="load_dir")
        try:
            header = json.loads(os.pread(self.fd, n, 8))
        except ValueError as err:
            raise BadInput(f"{self.path}: unreadable safetensors header ({err})", field="load_dir") from err
        self.tensors: dict[str, TensorRef] = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            if 8 + n + end > self.size:
                raise BadInput(
                    f"{self.path}: tensor {name} ends at byte {8 + n + end} but the file has "
                    f"{self.size} bytes (truncated?)",
                    field="load_dir",
                )
            if meta["dtype"] not in SAFETENSORS_DTYPES:
                raise BadInput(f"{self.path}: tensor {name} has unsupported dtype {meta['dtype']}", field="load_dir")
            dtype = SAFETENSORS_DTYPES[meta["dtype"]]
            self.tensors[name] = TensorRef(self, name, 8 + n + start, tuple(meta["shape"]), dtype)


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _LazyUnpickler(TorchUnpickler):
    """Turns tensors into ``(storage key, offset, shape, stride)`` records; other globals pass the allow-list."""

    def persistent_load(self, pid: Any) -> Any:  # Any: as pickle.Unpickler's (a record the stream holds)
        _, storage_type, key, _location, numel = pid
        dtype = storage_type if isinstance(storage_type, torch.dtype) else getattr(storage_type, "_dtype", None)
        if dtype is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the legacy typed-storage classes warn on .dtype
                dtype = storage_type.dtype
        return _StorageRef(str(key), dtype, int(numel))

    def find_class(self, module: str, name: str) -> Any:  # Any: as pickle.Unpickler's (a global the stream names)
        if module == "torch._utils" and name in ("_rebuild_tensor", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: ("tensor", storage, offset, tuple(size), tuple(stride))
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, requires_grad, backward_hooks, *rest: data
        return super().find_class(module, name)


class TorchZipFile(_File):
    """A ``torch.save`` zip file: ``.obj`` is its object with every tensor replaced by a ``TensorRef``."""

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(Path(path))
        try:
            with zipfile.ZipFile(self.path) as zf:
                infos = {i.filename.split("/", 1)[1]: i for i in zf.infolist() if "/" in i.filename}
                unpickler = _LazyUnpickler(zf.open(infos["data.pkl"]))
                unpickler.path = self.path
                raw = unpickler.load()
        except (zipfile.BadZipFile, KeyError, EOFError, pickle.UnpicklingError, ValueError) as err:
            raise BadInput(
                f"{self.path}: not a readable torch checkpoint, truncated? ({type(err).__name__}: {err})",
                field="load_dir",
            ) from err
        self._offsets = {name[5:]: self._data_offset(info) for name, info in infos.items() if name.startswith("data/")}
        self._sizes = {name[5:]: info.file_size for name, info in infos.items() if name.startswith("data/")}
        self.obj = self._resolve(raw, "")

    def _data_offset(self, info: zipfile.ZipInfo) -> int:
        local = os.pread(self.fd, 30, info.header_offset)
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        return info.header_offset + 30 + name_len + extra_len

    def _resolve(self, obj: Any, path: str) -> Any:  # Any: an unpickled tree, walked by its shape
        if isinstance(obj, tuple) and len(obj) == 5 and obj[0] == "tensor" and isinstance(obj[1], _StorageRef):
            return self._tensor(path, *obj[1:])
        if isinstance(obj, dict):
            return {k: self._resolve(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._resolve(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        return obj

    def _tensor(
        self, name: str, storage: _StorageRef, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]
    ) -> TensorRef | MemoryRef:
        if storage.key not in self._offsets:
            raise BadInput(f"{self.path}: tensor {name} has no data record (truncated?)", field="load_dir")
        contiguous = torch.empty(shape, device="meta").stride()
        elem = torch.empty((), dtype=storage.dtype).element_size()
        record_end = self._offsets[storage.key] + self._sizes[storage.key]
        if record_end > self.size or self._sizes[storage.key] < storage.numel * elem:
            raise BadInput(f"{self.path}: tensor {name} runs past the end of the file (truncated?)", field="load_dir")
        if stride != contiguous and int(torch.Size(shape).numel()) > 1:
            # A view saved with its whole storage (not what Megatron writes): read the storage, then the view.
            whole = TensorRef(self, name, self._offsets[storage.key], (storage.numel,), storage.dtype)
            return MemoryRef(torch.as_strided(whole.read(), shape, stride, offset).contiguous())
        ref = TensorRef(self, name, self._offsets[storage.key] + offset * elem, shape, storage.dtype)
        if ref.offset + ref.nbytes > record_end:
            raise BadInput(f"{self.path}: tensor {name} runs past its data record (truncated?)", field="load_dir")
        return ref


class MemoryRef:
    """The ``TensorRef`` interface over a tensor already in memory (old non-zip ``torch.save`` files)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.shape, self.dtype = tensor, tuple(tensor.shape), tensor.dtype

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.tensor if out is None else out.copy_(self.tensor)

    def read_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.tensor[start:stop]
        return rows if out is None else out.copy_(rows)


def read_merged(refs: list[Any], rule: str) -> torch.Tensor:
    """The full tensor from every TP rank's piece (``layout.merge``), read straight into place where rows allow."""
    first = refs[0]
    if rule == "rep" or len(refs) == 1:
        return first.read()
    if rule == "dim1":
        return torch.cat([r.read() for r in refs], dim=1)
    rows = first.shape[0]
    out = torch.empty((rows * len(refs), *first.shape[1:]), dtype=first.dtype)
    if rule == "dim0":
        for k, ref in enumerate(refs):
            ref.read(out[k * rows : (k + 1) * rows])
        return out
    half, total = rows // 2, rows * len(refs) // 2  # glu: rank k holds [gate_k; up_k]
    for k, ref in enumerate(refs):
        ref.read_rows(0, half, out[k * half : (k + 1) * half])
        ref.read_rows(half, rows, out[total + k * half : total + (k + 1) * half])
    return out
