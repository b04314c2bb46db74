"""The streamed ``torch.save`` writer: what torch and zip readers see, whatever the pieces a record is built from."""

from __future__ import annotations

import itertools
import os
import zipfile
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.checkpoint.fastcopy import InMemory, copy_segments, read_chunks
from engine.checkpoint.torchfile import LazyTensor, TorchFileWriter


@settings(max_examples=40, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=5000),
    cuts=st.lists(st.integers(0, 5000), max_size=6),
    chunk=st.sampled_from([1, 7, 64, 4096]),
)
def test_copied_pieces_are_the_concatenated_bytes(tmp_path_factory, data: bytes, cuts: list[int], chunk: int) -> None:
    """File ranges (read ``chunk`` bytes at a time) then row-interleaved in-memory parts, copied to an offset."""
    tmp = tmp_path_factory.mktemp("copy")
    (tmp / "src.bin").write_bytes(data)
    src, dst = os.open(tmp / "src.bin", os.O_RDONLY), os.open(tmp / "dst.bin", os.O_RDWR | os.O_CREAT)
    try:
        bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
        segments = [(src, a, b - a) for a, b in itertools.pairwise(bounds)][::-1]  # ranges in any order
        rows = torch.arange(2400, dtype=torch.int16).reshape(1200, 2)  # > 1,024 rows: two batches
        pieces = [*segments, InMemory([rows[:, :1], rows[:, 1:]])]  # rows interleaved: the tensor's own byte order
        expected = b"".join(data[a : a + n] for _, a, n in segments) + rows.numpy().tobytes()
        assert b"".join(bytes(c) for c in read_chunks(pieces, chunk=chunk)) == expected
        assert copy_segments(dst, 3, pieces) == len(expected)
        assert os.pread(dst, len(expected) + 10, 3) == expected
    finally:
        os.close(src)
        os.close(dst)


def test_records_from_tensors_and_file_ranges_load_in_torch_and_zip(tmp_path: Path) -> None:
    src = torch.randn(300, 64, dtype=torch.float32)
    (tmp_path / "src.bin").write_bytes(src.numpy().tobytes())
    a = LazyTensor("0", (100, 64), torch.float32)
    b = LazyTensor("1", (5,), torch.bfloat16)
    c = LazyTensor("2", (0,), torch.float16)
    fd = os.open(tmp_path / "src.bin", os.O_RDONLY)
    try:
        with TorchFileWriter(tmp_path / "out.pt", {"model": {"a": a, "b": b, "c": c}, "iteration": 7}, [a, b, c]) as w:
            row = 64 * 4
            w.write_segments(a, [(fd, 200 * row, 50 * row), (fd, 0, 50 * row)])  # rows 200:250 then 0:50
            w.write(b, torch.arange(5, dtype=torch.bfloat16))
            w.write(c, torch.empty(0, dtype=torch.float16))
    finally:
        os.close(fd)
    assert zipfile.ZipFile(tmp_path / "out.pt").testzip() is None  # every record's CRC is right
    for mmap in (False, True):
        state = torch.load(tmp_path / "out.pt", weights_only=True, mmap=mmap)
        assert state["iteration"] == 7
        assert torch.equal(state["model"]["a"], torch.cat([src[200:250], src[:50]]))
        assert torch.equal(state["model"]["b"], torch.arange(5, dtype=torch.bfloat16))
        assert state["model"]["c"].shape == (0,) and state["model"]["c"].dtype == torch.float16
