"""Megatron indexed datasets (``<prefix>.bin`` + ``<prefix>.idx``): streaming writer and memory-mapped reader.

Format (``megatron/core/datasets/indexed_dataset.py``, identical in core_r0.8.0 and core_v0.12.1), little-endian .idx:
magic ``MMIDIDX\\x00\\x00`` (9 bytes), u64 version 1, u8 dtype code, u64 sequence_count, u64 document_count,
int32[sequence_count] sequence lengths (tokens), int64[sequence_count] byte pointers into .bin (running sum of
length × itemsize), int64[document_count] document indices (starting at 0, one entry appended per finished document,
so document_count = documents + 1 and the last entry = sequence_count). The .bin is every sequence's tokens
concatenated in the dtype, no header. Dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
7 float32, 8 uint16. MindSpeed instruction data is always int32 (labels hold -100).

Datasets on disk:

- Pretraining: ``<prefix>_text_document`` (one per ``json_keys`` entry: ``<prefix>_<key>_document``).
- MindSpeed instruction data (training gets ``--data-path <prefix>``): ``<prefix>_packed_input_ids_document``,
  ``<prefix>_packed_attention_mask_document``, ``<prefix>_packed_labels_document``; sample ``i`` is sequence ``i`` of
  each (one sequence per document). With packing, a row's ``attention_mask`` is all 1 (MindSpeed ``--pack``) or the
  1-based sub-sample index per token with 0 on padding (``--neat-pack``), and this engine adds
  ``<prefix>_pack_boundaries`` (not matched by MindSpeed's ``<prefix>_packed_*_document*`` glob): row ``i`` holds the
  end offsets of its sub-samples (padding excluded), so boundaries survive plain ``--pack`` too.

Reader: ``IndexedDataset(prefix)`` (``len``, ``ds[i]`` -> numpy view, ``sequence_lengths``, ``document_indices``) and
``InstructionDataset(prefix)``: ``ds[i]`` -> ``Sample`` with ``input_ids`` / ``labels`` / ``attention_mask`` (int32
numpy arrays, labels -100 where not trained) and ``boundaries``: int64 end offsets of the sub-samples in the row
(``[len]`` for an unpacked sample); tokens ``[boundaries[k-1], boundaries[k])`` form sub-sample ``k`` (position ids
restart at each boundary, attention stays within it); tokens from ``boundaries[-1]`` on are padding.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[type, int] = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
CODE_DTYPES = {code: dt for dt, code in DTYPE_CODES.items()}
INSTRUCTION_FIELDS = ("input_ids", "attention_mask", "labels")
PAIRWISE_FIELDS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence_count, document_count


def instruction_prefix(output_prefix: str | os.PathLike[str], field: str) -> str:
    """MindSpeed's name of one field of an instruction dataset: ``<prefix>_packed_<field>_document``."""
    return f"{output_prefix}_packed_{field}_document"


def boundaries_prefix(output_prefix: str | os.PathLike[str]) -> str:
    return f"{output_prefix}_pack_boundaries"


class IndexedDatasetWriter:
    """Streaming writer: tokens go to ``.bin`` as they come, lengths to a side file; ``finalize`` writes the ``.idx``.

    Memory stays constant whatever the dataset size. Call ``add_item`` per sequence and ``end_document`` after each
    document (``add_document`` does both), then ``finalize``.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: type = np.int32):
        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {dtype} has no Megatron dtype code")
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        # Open for the writer's whole life; finalize() closes them.
        self._bin = open(self.prefix + ".bin", "wb")  # noqa: SIM115
        self._lengths = open(self.prefix + ".lengths.tmp", "wb")  # noqa: SIM115
        self._docs = open(self.prefix + ".docs.tmp", "wb")  # noqa: SIM115
        self.sequences = 0
        self.tokens = 0
        self._docs.write(np.zeros(1, np.int64).tobytes())
        self.documents = 1

    def add_item(self, tokens: np.ndarray | Iterable[int]) -> None:
        array = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._bin.write(array.tobytes())
        self._lengths.write(np.int32(array.size).tobytes())
        self.sequences += 1
        self.tokens += int(array.size)

    def end_document(self) -> None:
        self._docs.write(np.int64(self.sequences).tobytes())
        self.documents += 1

    def add_document(self, tokens: np.ndarray | Iterable[int]) -> None:
        self.add_item(tokens)
        self.end_document()

    def add_documents(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append many one-sequence documents at once: ``flat`` is their tokens concatenated, ``lengths`` their sizes."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != flat.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {flat.size} tokens were given")
        self._bin.write(np.ascontiguousarray(flat, dtype=self.dtype).tobytes())
        self._lengths.write(lengths.astype(np.int32).tobytes())
        self._docs.write(np.arange(self.sequences + 1, self.sequences + 1 + lengths.size, dtype=np.int64).tobytes())
        self.sequences += int(lengths.size)
        self.documents += int(lengths.size)
        self.tokens += int(flat.size)

    def finalize(self) -> None:
        """Write ``<prefix>.idx`` in bounded memory and remove the side files."""
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        with open(self.prefix + ".idx", "wb") as idx:
            idx.write(_HEADER.pack(MAGIC, VERSION, DTYPE_CODES[self.dtype.type], self.sequences, self.documents))
            with open(self.prefix + ".lengths.tmp", "rb") as src:
                shutil.copyfileobj(src, idx)
            offset = 0
            for lengths in _chunks(self.prefix + ".lengths.tmp", np.int32):
                pointers = np.cumsum(lengths, dtype=np.int64) * self.dtype.itemsize
                pointers = np.concatenate(([0], pointers[:-1])) + offset
                offset = int(pointers[-1]) + int(lengths[-1]) * self.dtype.itemsize
                idx.write(pointers.astype(np.int64).tobytes())
            with open(self.prefix + ".docs.tmp", "rb") as src:
                shutil.copyfileobj(src, idx)
        os.remove(self.prefix + ".lengths.tmp")
        os.remove(self.prefix + ".docs.tmp")

    def abort(self) -> None:
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        for suffix in (".bin", ".idx", ".lengths.tmp", ".docs.tmp"):
            Path(self.prefix + suffix).unlink(missing_ok=True)


def _chunks(path: str, dtype: type, count: int = 1 << 20) -> Iterable[np.ndarray]:
    with open(path, "rb") as f:
        while data := f.read(count * np.dtype(dtype).itemsize):
            yield np.frombuffer(data, dtype=dtype)


class IndexedDataset:
    """Memory-mapped reader of ``<prefix>.bin``/``.idx``; ``ds[i]`` is sequence ``i`` as a read-only numpy view."""

    def __init__(self, prefix: str | os.PathLike[str]):
        self.prefix = str(prefix)
        self._idx = np.memmap(self.prefix + ".idx", dtype=np.uint8, mode="r")
        if self._idx.size < _HEADER.size:
            raise ValueError(f"{self.prefix}.idx: too short to be a Megatron index")
        magic, version, code, n_seq, n_doc = _HEADER.unpack(self._idx[: _HEADER.size].tobytes())
        if magic != MAGIC or version != VERSION or code not in CODE_DTYPES:
            raise ValueError(
                f"{self.prefix}.idx: not a Megatron MMIDIDX v1 index (magic {magic!r}, version {version}, dtype {code})"
            )
        self.dtype = np.dtype(CODE_DTYPES[code])
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n_seq, offset)
        offset += 4 * n_seq
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n_seq, offset)
        offset += 8 * n_seq
        self.document_indices = np.frombuffer(self._idx, np.int64, n_doc, offset)
        if n_doc == 0 or self.document_indices[-1] != n_seq:
            raise ValueError(f"{self.prefix}.idx: document indices do not end at the sequence count {n_seq}")
        size = os.path.getsize(self.prefix + ".bin")
        self._bin = np.memmap(self.prefix + ".bin", dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return int(self.sequence_lengths.size)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        i %= len(self)
        return np.frombuffer(self._bin, self.dtype, int(self.sequence_lengths[i]), int(self.sequence_pointers[i]))

    def flat(self) -> np.ndarray:
        """Every sequence's items concatenated, as one read-only view of the ``.bin``."""
        return np.frombuffer(self._bin, self.dtype, int(self.sequence_lengths.sum(dtype=np.int64)))

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size - 1)


@dataclass(frozen=True)
class Sample:
    """One training row (see the module docstring)."""

    input_ids: np.ndarray
    labels: np.ndarray
    attention_mask: np.ndarray
    boundaries: np.ndarray


class InstructionDataset:
    """MindSpeed instruction dataset ``<prefix>_packed_{input_ids,attention_mask,labels}_document``."""

    def __init__(self, prefix: str | os.PathLike[str]):
        self.prefix = str(prefix)
        self.fields = {name: IndexedDataset(instruction_prefix(prefix, name)) for name in INSTRUCTION_FIELDS}
        sizes = {name: len(ds) for name, ds in self.fields.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"{prefix}: fields have different sample counts {sizes}")
        bounds = boundaries_prefix(prefix)
        self.boundaries = IndexedDataset(bounds) if os.path.exists(bounds + ".idx") else None

    def __len__(self) -> int:
        return len(self.fields["input_ids"])

    def __getitem__(self, i: int) -> Sample:
        ids, labels, mask = (self.fields[n][i] for n in ("input_ids", "labels", "attention_mask"))
        if self.boundaries is not None:
            bounds = self.boundaries[i].astype(np.int64)
        elif mask.size and mask.max() > 1:  # MindSpeed neat-pack: segment ids 1..k, padding 0
            bounds = np.flatnonzero(np.diff(np.concatenate((mask, [0]))) != 0) + 1
            bounds = bounds[mask[bounds - 1] > 0].astype(np.int64)
        else:
            bounds = np.asarray([ids.size], dtype=np.int64)
        return Sample(input_ids=ids, labels=labels, attention_mask=mask, boundaries=bounds)
