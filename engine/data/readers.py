"""Dataset file readers: one record at a time, memory bounded by a batch, never by the file.

``input_files(path)`` lists what to read: a file, or every supported file of a directory (sorted; one format per
directory, as MindSpeed requires). ``iter_raw(files)`` yields ``(file, number, payload)``: ``payload`` is the raw line
(``str``) for JSON lines, to be parsed by ``parse_record`` in a worker process, or an already decoded ``dict`` for
columnar formats. ``number`` is 1-based: the line of a .jsonl/.txt file (blank lines counted, not yielded), the row of a
.parquet/.csv/.arrow file (the csv header is not a row), the element of a .json array.

- ``.jsonl`` / ``.json`` with one object per line: streamed line by line.
- ``.json`` holding one array (first non-blank character ``[``): loaded whole (JSON arrays cannot be streamed here).
- ``.parquet``: ``pyarrow`` row-group batches. ``.csv``: ``pyarrow.csv`` streaming reader. ``.arrow``: Arrow IPC
  (the stream format ``datasets`` writes, or the file format).
- ``.txt``: one record ``{"text": line}`` per line (trailing newline removed), as ``datasets``' text loader does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.contract.runfiles import BadInput

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")
_BATCH_ROWS = 1024


class RecordError(ValueError):
    """A record that cannot be decoded; the caller adds the file and line."""


def input_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files to read for ``input``; raises ``BadInput`` (field ``input``) for a missing/mixed/unsupported input."""
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise BadInput(f"input: {p} has an unsupported extension; use one of {', '.join(SUFFIXES)}", field="input")
        return [p]
    if not p.is_dir():
        raise BadInput(f"input: {p} does not exist", field="input")
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in SUFFIXES)
    if not files:
        raise BadInput(f"input: directory {p} holds no {'/'.join(SUFFIXES)} file", field="input")
    kinds = {f.suffix.lower() for f in files}
    if len(kinds) > 1:
        raise BadInput(
            f"input: directory {p} mixes formats ({', '.join(sorted(kinds))}); keep one format per directory",
            field="input",
        )
    return files


def unit(file: str | os.PathLike[str]) -> str:
    """What ``number`` counts in this file: ``line`` or ``row``."""
    return "line" if Path(file).suffix.lower() in (".jsonl", ".json", ".txt") else "row"


def parse_record(payload: str | dict[str, Any]) -> dict[str, Any]:
    """Decode a raw JSON line into a dict (dicts pass through). Raises ``RecordError``."""
    if isinstance(payload, dict):
        return payload
    try:
        record = json.loads(payload)
    except json.JSONDecodeError as err:
        raise RecordError(f"malformed JSON: {err.msg} at column {err.colno}") from err
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    return record


def _iter_lines(file: Path) -> Iterator[tuple[int, str]]:
    with open(file, encoding="utf-8", errors="strict") as f:
        yield from enumerate(f, 1)


def _json_is_array(file: Path) -> bool:
    with open(file, encoding="utf-8") as f:
        while chunk := f.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[0] == "["
    return False


def _iter_json_array(file: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise BadInput(f"input: {file}, line {err.lineno}: malformed JSON: {err.msg}", field="input") from err
    for number, item in enumerate(data, 1):
        # Non-objects go through as text so that parse_record reports them with their position.
        yield number, item if isinstance(item, dict) else json.dumps(item)


def _iter_batches(file: Path) -> Iterator[list[dict[str, Any]]]:
    import pyarrow as pa

    suffix = file.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(file).iter_batches(batch_size=_BATCH_ROWS):
            yield batch.to_pylist()
    elif suffix == ".csv":
        import pyarrow.csv as pacsv

        # Every column as text, as written: "1" stays a string label, an empty cell stays "".
        names = pacsv.open_csv(file).schema.names
        convert = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=False)
        for batch in pacsv.open_csv(file, convert_options=convert):
            yield batch.to_pylist()
    else:  # .arrow
        with pa.memory_map(str(file)) as source:
            try:
                reader: Any = pa.ipc.open_stream(source)
                batches = iter(reader)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            for batch in batches:
                yield batch.to_pylist()


def _iter_file(file: Path) -> Iterator[tuple[int, str | dict[str, Any]]]:
    suffix = file.suffix.lower()
    if suffix == ".txt":
        for number, line in _iter_lines(file):
            yield number, {"text": line.rstrip("\r\n")}
    elif suffix in (".jsonl", ".json"):
        if suffix == ".json" and _json_is_array(file):
            yield from _iter_json_array(file)
            return
        for number, line in _iter_lines(file):
            if line.strip():
                yield number, line
    else:
        number = 0
        for rows in _iter_batches(file):
            for row in rows:
                number += 1
                yield number, row


def iter_raw(files: list[Path]) -> Iterator[tuple[str, int, str | dict[str, Any]]]:
    """``(file, number, payload)`` for every record of ``files`` in order; see the module docstring."""
    for file in files:
        try:
            for number, payload in _iter_file(file):
                yield str(file), number, payload
        except UnicodeDecodeError as err:
            raise BadInput(f"input: {file}: not UTF-8 text ({err.reason} at byte {err.start})", field="input") from err
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise BadInput(f"input: {file}: cannot read: {err}", field="input") from err


def count_records(files: list[Path]) -> int | None:
    """A cheap upper bound on the record count for progress totals (None when it would mean reading everything)."""
    total = 0
    for file in files:
        suffix = file.suffix.lower()
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(file).metadata.num_rows
        elif suffix in (".jsonl", ".txt") or (suffix == ".json" and not _json_is_array(file)):
            with open(file, "rb") as f:
                total += sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        else:
            return None
    return total
