"""Indexed datasets: byte layout per the Megatron specification, Megatron-Core's own reader and builder as oracles."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.contract.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    InstructionDataset,
    boundaries_prefix,
    instruction_prefix,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

SEQUENCES = [[5, 6, 7], [151645], [1, 2, 3, 4, -100], [9, 9]]


def write(prefix, sequences, dtype=np.int32, bulk=False):
    writer = IndexedDatasetWriter(prefix, dtype)
    if bulk:
        writer.add_documents(np.concatenate([np.asarray(s) for s in sequences]), [len(s) for s in sequences])
    else:
        for seq in sequences:
            writer.add_document(np.asarray(seq))
    writer.finalize()
    return prefix


@pytest.mark.parametrize("bulk", [False, True])
def test_idx_bytes_follow_the_specification(tmp_path, bulk):
    prefix = write(str(tmp_path / "d"), SEQUENCES, bulk=bulk)
    raw = open(prefix + ".idx", "rb").read()
    magic, version, code, n_seq, n_doc = struct.unpack_from("<9sQBQQ", raw, 0)
    assert (magic, version, code, n_seq, n_doc) == (b"MMIDIDX\x00\x00", 1, 4, 4, 5)
    offset = 9 + 8 + 1 + 8 + 8
    lengths = np.frombuffer(raw, np.int32, 4, offset)
    pointers = np.frombuffer(raw, np.int64, 4, offset + 16)
    docs = np.frombuffer(raw, np.int64, 5, offset + 16 + 32)
    assert lengths.tolist() == [3, 1, 5, 2]
    assert pointers.tolist() == [0, 12, 16, 36]  # byte offsets: running sum of length × 4
    assert docs.tolist() == [0, 1, 2, 3, 4]
    assert len(raw) == offset + 16 + 32 + 40
    assert np.fromfile(prefix + ".bin", np.int32).tolist() == [t for seq in SEQUENCES for t in seq]


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
def test_files_are_byte_identical_to_megatron_builder(tmp_path, dtype):
    sequences = [[abs(x) for x in s] for s in SEQUENCES]
    ours = write(str(tmp_path / "ours"), sequences, dtype)
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for seq in sequences:
        builder.add_item(torch.tensor(seq))
        builder.end_document()
    builder.finalize(str(tmp_path / "ref.idx"))
    for suffix in (".bin", ".idx"):
        assert open(ours + suffix, "rb").read() == open(str(tmp_path / "ref") + suffix, "rb").read()


def test_megatron_reads_what_we_write(tmp_path):
    prefix = write(str(tmp_path / "d"), SEQUENCES)
    ref = MegatronIndexedDataset(prefix)
    assert len(ref) == 4 and ref.document_indices.tolist() == [0, 1, 2, 3, 4]
    for i, seq in enumerate(SEQUENCES):
        assert ref[i].tolist() == seq
    assert ref.get(2, offset=1, length=2).tolist() == [2, 3]


def test_our_reader_matches_megatron_on_multi_sequence_documents(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.int32)
    builder.add_document(torch.tensor([1, 2, 3, 4, 5]), [2, 3])
    builder.add_document(torch.tensor([7]), [1])
    builder.finalize(str(tmp_path / "ref.idx"))
    ours, ref = IndexedDataset(str(tmp_path / "ref")), MegatronIndexedDataset(str(tmp_path / "ref"))
    assert len(ours) == len(ref) == 3 and ours.num_documents == 2
    assert ours.document_indices.tolist() == ref.document_indices.tolist() == [0, 2, 3]
    assert [ours[i].tolist() for i in range(3)] == [ref[i].tolist() for i in range(3)] == [[1, 2], [3, 4, 5], [7]]
    assert ours[-1].tolist() == [7]
    with pytest.raises(IndexError):
        ours[3]


def test_empty_dataset_is_readable_by_ours(tmp_path):
    # Megatron cannot mmap an empty .bin, which is why preprocessing refuses to write a dataset with no sample.
    prefix = write(str(tmp_path / "e"), [])
    assert len(IndexedDataset(prefix)) == 0


def test_corrupt_index_is_refused(tmp_path):
    prefix = write(str(tmp_path / "d"), SEQUENCES)
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[0:1] = b"X"
    open(prefix + ".idx", "wb").write(bytes(raw))
    with pytest.raises(ValueError, match="not a Megatron MMIDIDX v1 index"):
        IndexedDataset(prefix)


def _instruction(tmp_path, rows, masks, bounds=None):
    base = str(tmp_path / "inst")
    write(instruction_prefix(base, "input_ids"), rows)
    write(instruction_prefix(base, "labels"), [[-100] + r[1:] for r in rows])
    write(instruction_prefix(base, "attention_mask"), masks)
    if bounds is not None:
        write(boundaries_prefix(base), bounds)
    return InstructionDataset(base)


def test_instruction_dataset_sample(tmp_path):
    ds = _instruction(tmp_path, [[1, 2, 3], [4, 5]], [[1, 1, 1], [1, 1]])
    sample = ds[0]
    assert len(ds) == 2 and sample.input_ids.tolist() == [1, 2, 3] and sample.labels.tolist() == [-100, 2, 3]
    assert sample.boundaries.tolist() == [3]


def test_boundaries_from_side_file_or_neat_mask(tmp_path):
    side = _instruction(tmp_path, [[1, 2, 3, 4, 0, 0]], [[1] * 6], bounds=[[1, 4]])
    assert side[0].boundaries.tolist() == [1, 4]
    neat = (
        _instruction(tmp_path / "n", [[1, 2, 3, 4, 0, 0]], [[1, 2, 2, 2, 0, 0]])
        if (tmp_path / "n").mkdir() is None
        else None
    )
    assert neat[0].boundaries.tolist() == [1, 4]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.integers(-100, 151935), max_size=40), min_size=1, max_size=30).filter(any), st.booleans())
def test_any_sequences_round_trip_through_megatron(tmp_path, sequences, bulk):
    # At least one token: Megatron cannot map an empty .bin (see test_empty_dataset_is_readable_by_ours).
    prefix = write(str(tmp_path / f"h{abs(hash(str(sequences))) % 10**9}"), sequences, bulk=bulk)
    ref, ours = MegatronIndexedDataset(prefix), IndexedDataset(prefix)
    assert [ref[i].tolist() for i in range(len(ref))] == [ours[i].tolist() for i in range(len(ours))] == sequences
