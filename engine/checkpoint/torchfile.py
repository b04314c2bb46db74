"""Write a ``torch.save``-format file whose tensors arrive one at a time, so a rank file never sits whole in memory.

``torch.save`` needs every tensor of a Megatron rank file (hundreds of MB to GB) alive at once. The format is a
plain stored (uncompressed) zip: ``data.pkl`` (the pickled object, each tensor pickled as
``torch._utils._rebuild_tensor_v2`` over a persistent ``("storage", <dtype>Storage, key, "cpu", numel)`` id), then
``.format_version``, ``.storage_alignment``, ``byteorder``, one ``data/<key>`` record per storage with its bytes
aligned to 64 (what ``torch.load(mmap=True)`` maps), ``version`` and ``.data/serialization_id`` — the records
``torch.serialization._save`` writes in torch 2.13. Since the pickle only needs shapes and dtypes, it is written
first from placeholders; the bytes follow as the converter produces them, written by a background thread so
building the next tensor overlaps writing this one.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import queue
import random
import struct
import sys
import threading
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, SupportsIndex

import torch

from engine.checkpoint.fastcopy import Piece, read_chunks, size_of
from engine.torch_compat import rebuild_tensor_v2

if TYPE_CHECKING:
    from typing_extensions import Self

ALIGNMENT = 64
_STORAGE_TYPES = {
    torch.bfloat16: "BFloat16Storage",
    torch.float16: "HalfStorage",
    torch.float32: "FloatStorage",
    torch.float64: "DoubleStorage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.uint8: "ByteStorage",
    torch.int8: "CharStorage",
    torch.bool: "BoolStorage",
}
_DONE = object()


class BackgroundWriter:
    """Runs ``write(item)`` on one thread for queued items, so producing the next tensor overlaps writing this one
    (file writes and CRCs release the GIL). At most ``depth`` items wait; an error surfaces on ``put``/``close``."""

    def __init__(self, write: Callable[[Any], Any], name: str, depth: int = 2):
        self._write = write
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._drain, name=name, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while (item := self.queue.get()) is not _DONE:
            if self.error is None:
                try:
                    self._write(item)
                except BaseException as err:  # noqa: BLE001 - re-raised in the producer thread
                    self.error = err

    def put(self, item: object) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(item)

    def close(self) -> None:
        """Wait for every queued write; raise the first error."""
        self.queue.put(_DONE)
        self.thread.join()
        if self.error is not None:
            raise self.error


def tensor_bytes(tensor: torch.Tensor) -> memoryview | bytes:
    """The raw bytes of a contiguous CPU tensor, without a copy (bf16 included, which numpy lacks)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else b""


class _Storage:
    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class LazyTensor:
    """Stands in for a contiguous tensor of ``shape``/``dtype`` while the pickle is written."""

    def __init__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype = tuple(shape), dtype
        self.storage = _Storage(key, dtype, int(torch.Size(shape).numel()))

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[object, ...]:
        stride = torch.empty(self.shape, device="meta").stride()
        return (rebuild_tensor_v2, (self.storage, 0, self.shape, stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: object) -> tuple[object, ...] | None:
        if isinstance(obj, _Storage):
            return ("storage", getattr(torch, _STORAGE_TYPES[obj.dtype]), obj.key, "cpu", obj.numel)
        return None


class TorchFileWriter:
    """``with TorchFileWriter(path, obj, lazies) as w: w.write(lazy, tensor)`` for every placeholder, in order."""

    def __init__(self, path: str | os.PathLike[str], obj: object, lazy: Iterable[LazyTensor]):
        self.path = Path(path)
        self.prefix = self.path.stem
        self.pending = collections.deque(lazy)
        self.zip = zipfile.ZipFile(self.path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)  # torch.save's default protocol
        self._record("data.pkl", buf.getvalue())
        self._record(".format_version", b"1")
        self._record(".storage_alignment", str(ALIGNMENT).encode())
        self._record("byteorder", sys.byteorder.encode())
        self.writer = BackgroundWriter(self._write_tensor, name=f"write-{self.path.name}")

    def _info(self, name: str, size: int) -> tuple[zipfile.ZipInfo, bool]:
        info = zipfile.ZipInfo(f"{self.prefix}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        zip64 = size * 1.05 > zipfile.ZIP64_LIMIT
        # local header (30) + name + our padding field (4 + pad) [+ zip64 sizes (20)], then the data
        fp = self.zip.fp
        assert fp is not None  # open for writing until close()
        start = fp.tell() + 30 + len(info.filename.encode()) + 4 + (20 if zip64 else 0)
        pad = -start % ALIGNMENT
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding field, as PyTorch's writer
        return info, zip64

    def _record(self, name: str, data: bytes | memoryview) -> None:
        info, zip64 = self._info(name, len(data))
        with self.zip.open(info, "w", force_zip64=zip64) as f:
            f.write(data)

    def write(self, lazy: LazyTensor, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` as the bytes of ``lazy`` (which must be the next pending placeholder)."""
        if tuple(tensor.shape) != lazy.shape or tensor.dtype != lazy.dtype:
            raise RuntimeError(
                f"{self.path}: expected {lazy.shape} {lazy.dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        self._next(lazy)
        # to the host here: the writer thread turns bytes into numpy, which reads no accelerator memory
        self.writer.put((lazy, tensor.detach().to("cpu").contiguous()))

    def write_segments(self, lazy: LazyTensor, segments: list[Piece]) -> None:
        """Queue file byte ranges (and in-memory pieces) whose concatenation is the bytes of ``lazy``."""
        nbytes = int(torch.Size(lazy.shape).numel()) * lazy.dtype.itemsize
        if sum(map(size_of, segments)) != nbytes:
            raise RuntimeError(f"{self.path}: segments do not cover the {nbytes} bytes of record {lazy.storage.key}")
        self._next(lazy)
        self.writer.put((lazy, segments))

    def _next(self, lazy: LazyTensor) -> None:
        expected = self.pending.popleft() if self.pending else None
        if expected is not lazy:
            raise RuntimeError(f"{self.path}: record {lazy.storage.key} written out of order")

    def _write_tensor(self, item: tuple[LazyTensor, Any]) -> None:
        lazy, data = item
        name = f"data/{lazy.storage.key}"
        if isinstance(data, torch.Tensor):
            self._record(name, tensor_bytes(data))
            return
        info, zip64 = self._info(name, sum(map(size_of, data)))
        with self.zip.open(info, "w", force_zip64=zip64) as f:
            for chunk in read_chunks(data):  # zipfile computes the CRC of each chunk while it is in the CPU cache
                f.write(chunk)

    def close(self) -> None:
        self.writer.close()
        if self.pending:
            raise RuntimeError(f"{self.path}: {len(self.pending)} tensors were never written")
        self._record("version", b"3\n")
        self._record(".data/serialization_id", str(random.randrange(10**19, 10**20)).encode())
        self.zip.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(BaseException):  # the producer's own error is the one to report
            self.writer.close()
        self.zip.close()
