"""The preprocess runner in-process: outputs, packing, over-long policy, bad input, atomic outputs, pretraining text."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from engine.contract.flags import spec_from_argv
from engine.contract.indexed import IndexedDataset, InstructionDataset, boundaries_prefix, instruction_prefix
from engine.contract.runfiles import BadInput, RunDir
from engine.contract.spec import PreprocessSpec
from engine.data.templates import IGNORE_INDEX, encode_conversation
from engine.data.tokenizer import load_tokenizer
from engine.preprocess import run

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset

SEED_MAP = '{"messages":"messages", "tags":{"role_tag": "role","content_tag": "content","user_tag": "user","assistant_tag": "assistant","system_tag": "system"}}'


def conversation(i: int) -> dict:
    question = "用户：" + "广州塔为什么也叫小蛮腰" * (1 + i % 7)
    return {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {
                "role": "user",
                "content": f"请你判读用户的意图。交互历史：{question}\n用户最后一句话所属的技能和意图是：",
            },
            {"role": "assistant", "content": f"意图_{i % 5}"},
        ]
    }


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps(conversation(i), ensure_ascii=False) + "\n" for i in range(40)), encoding="utf-8"
    )
    return path


def make_spec(tmp_path, data, tok_dir, **over) -> PreprocessSpec:
    fields = dict(
        input=str(data),
        tokenizer_name_or_path=str(tok_dir),
        output_prefix=str(tmp_path / "out" / "customed"),
        handler_name="SharegptStyleInstructionHandler",
        prompt_type="qwen3",
        enable_thinking="true",
        map_keys=SEED_MAP,
        log_interval=10,
    )
    return PreprocessSpec(**{**fields, **over})


def test_instruction_outputs_match_encode_conversation(tmp_path, data, qwen_tokenizer_dir):
    spec = make_spec(tmp_path, data, qwen_tokenizer_dir)
    outputs, summary = run(spec, RunDir(tmp_path / "run"))
    prefix = str(tmp_path / "out" / "customed")
    assert outputs["data_path"] == prefix
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        f"customed_packed_{f}_document.{s}" for f in ("attention_mask", "input_ids", "labels") for s in ("bin", "idx")
    )
    tok = load_tokenizer(str(qwen_tokenizer_dir))
    ids, labels, mask = (
        MegatronIndexedDataset(instruction_prefix(prefix, f)) for f in ("input_ids", "labels", "attention_mask")
    )
    assert len(ids) == len(labels) == len(mask) == 40
    for i in (0, 17, 39):
        want_ids, want_labels = encode_conversation(tok, conversation(i)["messages"], "qwen3", "true")
        assert ids[i].tolist() == want_ids.tolist() and labels[i].tolist() == want_labels.tolist()
        assert mask[i].tolist() == [1] * len(want_ids)
    trained = sum(int((labels[i] != IGNORE_INDEX).sum()) for i in range(40))
    tokens = sum(len(ids[i]) for i in range(40))
    assert summary["samples_read"] == summary["samples_written"] == 40 and summary["samples_dropped"] == {}
    assert summary["tokens"] == tokens and summary["masked_token_ratio"] == pytest.approx(
        1 - trained / tokens, abs=1e-6
    )
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    progress = [e["data"] for e in events if e["type"] == "progress"]  # reported at chunk ends past each interval
    assert progress[-1] == {"done": 40, "total": 40, "unit": "samples"}
    assert [p["done"] for p in progress] == sorted(p["done"] for p in progress)


@pytest.mark.parametrize("neat", [False, True])
def test_packing_rows_are_seq_length_and_keep_samples(tmp_path, data, qwen_tokenizer_dir, neat):
    spec = make_spec(tmp_path, data, qwen_tokenizer_dir, seq_length=256, pack=True, neat_pack=neat)
    _, summary = run(spec, RunDir(tmp_path / "run"))
    prefix = str(tmp_path / "out" / "customed")
    ds = InstructionDataset(prefix)
    assert all(len(MegatronIndexedDataset(instruction_prefix(prefix, "input_ids"))[i]) == 256 for i in range(len(ds)))
    assert len(ds) == summary["sequences"] < 40
    tok = load_tokenizer(str(qwen_tokenizer_dir))
    expected = {
        tuple(encode_conversation(tok, conversation(i)["messages"], "qwen3", "true")[0].tolist()) for i in range(40)
    }
    found = set()
    for row in (ds[i] for i in range(len(ds))):
        starts = np.concatenate(([0], row.boundaries[:-1]))
        found |= {tuple(row.input_ids[s:e].tolist()) for s, e in zip(starts, row.boundaries)}
        assert (row.labels[row.boundaries[-1] :] == IGNORE_INDEX).all()
        if neat:
            assert (
                row.attention_mask.max() == len(row.boundaries)
                and (row.attention_mask[row.boundaries[-1] :] == 0).all()
            )
    assert found == expected
    assert summary["pad_tokens"] == 256 * len(ds) - summary["tokens"]


@pytest.mark.parametrize("policy", ["drop", "truncate"])
def test_overlong_policy_is_reported(tmp_path, data, qwen_tokenizer_dir, policy):
    spec = make_spec(tmp_path, data, qwen_tokenizer_dir, seq_length=70, overlong_policy=policy)
    _, summary = run(spec, RunDir(tmp_path / "run"))
    ref = MegatronIndexedDataset(instruction_prefix(str(tmp_path / "out" / "customed"), "input_ids"))
    assert ref.sequence_lengths.max() <= 69  # keep `ref` alive: Megatron unmaps on __del__
    if policy == "drop":
        assert summary["samples_dropped"]["too_long"] > 0 and summary["truncated"] == 0
        assert summary["samples_written"] == 40 - summary["samples_dropped"]["too_long"]
    else:  # MindSpeed's proportional cut: every sample kept, each with trained tokens
        assert summary["truncated"] > 0 and summary["samples_written"] == 40 and summary["samples_dropped"] == {}


def test_bad_line_fails_with_file_and_line_and_leaves_nothing(tmp_path, data, qwen_tokenizer_dir):
    lines = data.read_text(encoding="utf-8").splitlines()
    lines[6] = '{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}'
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(BadInput, match=r"train\.jsonl, line 7: turn 1: unknown role 'robot'"):
        run(make_spec(tmp_path, data, qwen_tokenizer_dir), RunDir(tmp_path / "run"))
    assert list((tmp_path / "out").iterdir()) == []  # no dataset, and no temporary directory either


def test_skip_bad_samples_counts_them(tmp_path, data, qwen_tokenizer_dir):
    with data.open("a", encoding="utf-8") as f:
        f.write("{broken\n" + json.dumps({"messages": []}) + "\n")
        call = [{"role": "user", "content": "q"}, {"role": "function_call", "content": "not json"}]
        f.write(json.dumps({"messages": call}) + "\n")
    keys = json.loads(SEED_MAP)
    keys["tags"]["function_tag"] = "function_call"
    _, summary = run(
        make_spec(tmp_path, data, qwen_tokenizer_dir, skip_bad_samples=True, map_keys=keys), RunDir(tmp_path / "run")
    )
    assert summary["bad_samples_skipped"] == 3 and summary["samples_written"] == 40
    assert summary["bad_sample_examples"][2].endswith("line 43: function call content is not JSON: Expecting value")
    assert summary["bad_sample_examples"][0].endswith(
        "line 41: malformed JSON: Expecting property name enclosed in double quotes at column 2"
    )


def test_failed_rerun_keeps_no_half_written_dataset(tmp_path, data, qwen_tokenizer_dir, monkeypatch):
    run(make_spec(tmp_path, data, qwen_tokenizer_dir), RunDir(tmp_path / "run"))
    from engine import preprocess as job

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(job._Outputs, "commit", crash)
    with pytest.raises(RuntimeError):
        run(make_spec(tmp_path, data, qwen_tokenizer_dir, enable_thinking="false"), RunDir(tmp_path / "run"))
    # The earlier complete dataset is untouched and nothing partial is visible.
    assert len(MegatronIndexedDataset(instruction_prefix(str(tmp_path / "out" / "customed"), "labels"))) == 40
    assert not any(p.name.startswith(".") for p in (tmp_path / "out").iterdir())


def test_pack_rerun_without_pack_removes_stale_boundaries(tmp_path, data, qwen_tokenizer_dir):
    run(make_spec(tmp_path, data, qwen_tokenizer_dir, seq_length=256, pack=True), RunDir(tmp_path / "run"))
    bounds = boundaries_prefix(str(tmp_path / "out" / "customed"))
    assert IndexedDataset(bounds)
    run(make_spec(tmp_path, data, qwen_tokenizer_dir), RunDir(tmp_path / "run"))
    assert not list((tmp_path / "out").glob("customed_pack_boundaries*"))
    assert InstructionDataset(str(tmp_path / "out" / "customed"))[0].boundaries.size == 1


def test_pretraining_text_document(tmp_path, qwen_tokenizer_dir):
    path = tmp_path / "corpus.txt"
    path.write_text("hello world\n\nsecond document\n")
    spec = PreprocessSpec(
        input=str(path),
        tokenizer_name_or_path=str(qwen_tokenizer_dir),
        output_prefix=str(tmp_path / "out" / "corpus"),
        append_eod=True,
    )
    outputs, summary = run(spec, RunDir(tmp_path / "run"))
    assert outputs["data_path"] == str(tmp_path / "out" / "corpus_text_document")
    ds = MegatronIndexedDataset(outputs["data_path"])
    tok = load_tokenizer(str(qwen_tokenizer_dir))
    assert ds[0].tolist() == tok("hello world", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert len(ds) == 2 and summary["samples_dropped"] == {"empty_text": 1}


def test_mindspeed_flags_and_spec_file_build_the_same_spec(tmp_path, data, qwen_tokenizer_dir):
    argv = [
        "--input",
        str(data),
        "--tokenizer-name-or-path",
        str(qwen_tokenizer_dir),
        "--output-prefix",
        str(tmp_path / "customed"),
        "--handler-name",
        "SharegptStyleInstructionHandler",
        "--tokenizer-type",
        "PretrainedFromHF",
        "--enable-thinking",
        "true",
        "--workers",
        "4",
        "--log-interval",
        "1000",
        "--map-keys",
        SEED_MAP,
        "--prompt-type",
        "qwen3",
    ]
    from_flags, _, ignored = spec_from_argv("preprocess", argv)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(from_flags.model_dump_json())
    from_file, _, _ = spec_from_argv("preprocess", ["--spec", str(spec_file)])
    assert from_flags == from_file and ignored == []
    assert (
        from_flags.map_keys["tags"]["role_tag"] == "role"
        and from_flags.enable_thinking == "true"
        and from_flags.workers == 4
    )


@pytest.mark.parametrize(
    "over, message",
    [
        ({"pack": True}, "seq_length: required with pack"),
        ({"neat_pack": True}, "neat_pack: requires pack"),
        ({"prompt_type": None}, "prompt_type: required with SharegptStyleInstructionHandler"),
        ({"prompt_type": "llama3"}, "prompt_type: 'llama3' is not supported"),
        ({"handler_name": "MOSSInstructionHandler"}, "handler_name: 'MOSSInstructionHandler' is not supported"),
        ({"enable_thinking": "maybe"}, "enable_thinking"),
    ],
)
def test_spec_validation_names_the_field(tmp_path, data, qwen_tokenizer_dir, over, message):
    with pytest.raises(ValueError, match=message):
        make_spec(tmp_path, data, qwen_tokenizer_dir, **over)


def test_alpaca_parquet_directory_with_hf_template(tmp_path, qwen_tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "alpaca"
    src.mkdir()
    rows = [{"instruction": f"Classify {i}", "input": "text" if i % 2 else "", "output": f"label{i}"} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows[:3]), src / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[3:]), src / "b.parquet")
    spec = PreprocessSpec(
        input=str(src),
        tokenizer_name_or_path=str(qwen_tokenizer_dir),
        output_prefix=str(tmp_path / "out" / "alp"),
        handler_name="AlpacaStyleInstructionHandler",
        prompt_type="hf",
        enable_thinking="false",
    )
    _, summary = run(spec, RunDir(tmp_path / "run"))
    assert summary["samples_written"] == 6
    tok = load_tokenizer(str(qwen_tokenizer_dir))
    ds = InstructionDataset(str(tmp_path / "out" / "alp"))
    for i, row in enumerate(rows):
        user = row["instruction"] + ("\n" + row["input"] if row["input"] else "")
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
        assert ds[i].input_ids.tolist() == list(
            tok.apply_chat_template(messages, tokenize=True, enable_thinking=False)["input_ids"]
        )
        assert tok.decode([t for t in ds[i].labels.tolist() if t != IGNORE_INDEX]) == f"label{i}<|im_end|>\n"


def test_partials_of_dead_runs_are_removed(tmp_path, data, qwen_tokenizer_dir):
    (tmp_path / "out").mkdir()
    dead = tmp_path / "out" / ".customed.partial-999999999"
    dead.mkdir()
    (dead / "customed_packed_labels_document.bin").write_bytes(b"x")
    run(make_spec(tmp_path, data, qwen_tokenizer_dir), RunDir(tmp_path / "run"))
    assert not dead.exists()


def test_non_zero_ranks_do_not_write(tmp_path, data, qwen_tokenizer_dir, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    outputs, summary = run(make_spec(tmp_path, data, qwen_tokenizer_dir), RunDir(tmp_path / "run", rank=1))
    assert outputs == {} and "rank 0 only" in summary["skipped"] and not (tmp_path / "out").exists()


def test_bad_map_keys_are_refused_at_submission(tmp_path, data, qwen_tokenizer_dir):
    with pytest.raises(ValueError, match="map_keys: unknown key"):
        make_spec(tmp_path, data, qwen_tokenizer_dir, map_keys={"message": "messages"})
    with pytest.raises(ValueError, match="map_keys: tags must be an object"):
        make_spec(tmp_path, data, qwen_tokenizer_dir, map_keys={"tags": {"speaker_tag": "who"}})
