"""Readers (every file type) and formats (ShareGPT, OpenAI, Alpaca, map_keys), with the bad-input messages."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.contract.runfiles import BadInput
from engine.data.formats import Converter, FormatError, iter_conversations
from engine.data.readers import count_records, input_files, iter_raw

SEED_MAP = {
    "messages": "messages",
    "tags": {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "system_tag": "system",
    },
}
OPENAI = {
    "messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
}
SHAREGPT = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}], "system": "S"}
ALPACA = {"instruction": "Do", "input": "this", "output": "done", "system": "S", "history": [["q0", "a0"]]}
EXPECTED = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".json-array", ".parquet", ".arrow"])
def test_every_file_type_yields_the_same_conversations(tmp_path, suffix):
    records = [OPENAI, OPENAI]
    if suffix == ".json-array":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(records))
    elif suffix in (".jsonl", ".json"):
        path = write_jsonl(tmp_path / f"d{suffix}", records)
    else:
        table = pa.Table.from_pylist(records)
        path = tmp_path / f"d{suffix}"
        if suffix == ".parquet":
            pq.write_table(table, path)
        else:  # the IPC stream format `datasets` writes
            with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
    got = list(iter_conversations(path, SEED_MAP))
    assert [(n, m) for _, n, m in got] == [(1, EXPECTED), (2, EXPECTED)]


def test_csv_alpaca_and_txt(tmp_path):
    csv = tmp_path / "a.csv"
    csv.write_text('instruction,input,output\nDo,,done\n"Rate, please",it,5\n')
    assert [m for _, _, m in iter_conversations(csv, None, "AlpacaStyleInstructionHandler")] == [
        [{"role": "user", "content": "Do"}, {"role": "assistant", "content": "done"}],
        [{"role": "user", "content": "Rate, please\nit"}, {"role": "assistant", "content": "5"}],
    ]
    txt = tmp_path / "t.txt"
    txt.write_text("first line\nsecond\n")
    assert [p for _, _, p in iter_raw(input_files(txt))] == [{"text": "first line"}, {"text": "second"}]
    assert count_records(input_files(txt)) == 2


def test_directory_is_read_in_sorted_order_and_must_be_one_format(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [OPENAI])
    write_jsonl(tmp_path / "a.jsonl", [OPENAI])
    assert [f.name for f in input_files(tmp_path)] == ["a.jsonl", "b.jsonl"]
    (tmp_path / "c.csv").write_text("x\n1\n")
    with pytest.raises(BadInput, match="mixes formats"):
        input_files(tmp_path)
    with pytest.raises(BadInput, match="does not exist"):
        input_files(tmp_path / "missing")
    (tmp_path / "x.xml").write_text("")
    with pytest.raises(BadInput, match="unsupported extension"):
        input_files(tmp_path / "x.xml")


def test_sharegpt_defaults_and_system_column():
    assert Converter("SharegptStyleInstructionHandler", {"system": "system"}).messages(SHAREGPT) == EXPECTED
    no_system = Converter("SharegptStyleInstructionHandler").messages(SHAREGPT)
    assert no_system == EXPECTED[1:]  # the system column is read only when mapped


def test_openai_records_are_recognised_without_map_keys():
    assert Converter("SharegptStyleInstructionHandler").messages(OPENAI) == EXPECTED


def test_map_keys_remap_columns_and_role_tags():
    record = {
        "dialog": [
            {"speaker": "boss", "text": "Q"},
            {"speaker": "bot", "text": "A"},
            {"speaker": "env", "text": "R"},
            {"speaker": "bot", "text": "B"},
        ]
    }
    keys = {
        "messages": "dialog",
        "tags": {
            "role_tag": "speaker",
            "content_tag": "text",
            "user_tag": "boss",
            "assistant_tag": "bot",
            "observation_tag": "env",
        },
    }
    assert [m["role"] for m in Converter("SharegptStyleInstructionHandler", keys).messages(record)] == [
        "user",
        "assistant",
        "observation",
        "assistant",
    ]


def test_alpaca_history_and_system_only_when_mapped():
    plain = Converter("AlpacaStyleInstructionHandler").messages(ALPACA)
    assert plain == [{"role": "user", "content": "Do\nthis"}, {"role": "assistant", "content": "done"}]
    full = Converter("AlpacaStyleInstructionHandler", {"system": "system", "history": "history"}).messages(ALPACA)
    assert [m["content"] for m in full] == ["S", "q0", "a0", "Do\nthis", "done"]


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"messages": []}, "empty conversation"),
        ({"messages": [{"role": "user", "content": "Q"}]}, "must end with an assistant turn"),
        (
            {"messages": [{"role": "user", "content": "Q"}, {"role": "bot", "content": "A"}]},
            "turn 1: unknown role 'bot'",
        ),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "A"}]}, "turn 0: missing key 'content'"),
        ({"conversation": []}, "missing key 'messages'"),
        ({"messages": "hello"}, "must be a list"),
    ],
)
def test_bad_records_name_the_problem(record, problem):
    with pytest.raises(FormatError, match=problem):
        Converter("SharegptStyleInstructionHandler", SEED_MAP).messages(record)


def test_iter_conversations_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(OPENAI) + "\n\n{not json\n")
    with pytest.raises(BadInput, match=r"bad\.jsonl, line 3: malformed JSON"):
        list(iter_conversations(path, SEED_MAP))


def test_unknown_map_keys_and_handlers_are_refused():
    with pytest.raises(ValueError, match="map_keys: unknown key"):
        Converter("SharegptStyleInstructionHandler", {"messagez": "m"})
    with pytest.raises(ValueError, match="handler_name: 'MOSSInstructionHandler' is not supported"):
        Converter("MOSSInstructionHandler")
