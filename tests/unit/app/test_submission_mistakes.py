"""A sweep of realistic mistakes (issue 27's and more): each is refused at submission (422) with the field named,
and none leaves a job or a file behind. The table in docs/submission-mistakes.md is this list."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from core.db import session_scope
from core.models import Host
from core.settings import Settings
from core_support import auth, isolated_settings, make_token, team_dir
from engine.contract import owner


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return _settings(tmp_path)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, str, Settings]]:
    """One service (client, alpha's token, settings; a 4-slot cpu host) for the whole sweep: a refused mistake
    stores nothing, so the cases can share its database and files. Each still checks, after its own submission,
    that alpha has no job and its area no new file (a case that stored one fails there itself)."""
    settings = _settings(tmp_path_factory.mktemp("sweep"))
    register_host(settings, 4)
    with TestClient(create_app(settings, reconcile=False)) as client:
        yield client, make_token(settings, "alpha"), settings


def _settings(var: Path) -> Settings:
    settings = isolated_settings(var, max_train_iters=10_000, max_train_tokens=10**9)
    _team_files(team_dir(settings, "alpha"))
    return settings


def _team_files(data: Path) -> None:
    (data / "in.jsonl").write_text('{"text": "hi"}\n')
    (data / "tok").mkdir()
    (data / "tok" / "tokenizer_config.json").write_text("{}")
    for suffix in (".bin", ".idx"):
        (data / f"ds_packed_input_ids_document{suffix}").write_bytes(b"")
    (data / "hf").mkdir()
    config = {
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "max_position_embeddings": 2048,
    }
    (data / "hf" / "config.json").write_text(json.dumps(config))
    (data / "hf" / "model.safetensors").write_bytes(b"")
    (data / "llama").mkdir()
    (data / "llama" / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    (data / "llama" / "model.safetensors").write_bytes(b"")
    (data / "empty").mkdir()
    write_finished_run(data / "runs" / "old", "job-old", 20)
    _full_and_adapters(data)


def _full_and_adapters(data: Path) -> None:
    """``full``: an HF model whose safetensors hold base weights; ``lora-save``: a LoRA run's final export (adapter
    tensors only, Megatron layout), as engine.contract.inspect reads them."""
    import torch

    (data / "full").mkdir()
    (data / "full" / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (data / "full" / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    rank = data / "lora-save" / "iter_0000020" / "mp_rank_00"
    rank.mkdir(parents=True)
    qkv = "decoder.layers.0.self_attention.linear_qkv"
    torch.save({"model": {f"{qkv}.lora_{ab}.weight": torch.zeros(2, 2) for ab in "AB"}}, rank / "model_optim_rng.pt")
    (data / "lora-save" / "latest_checkpointed_iteration.txt").write_text("20")


def write_finished_run(save: Path, job_id: str, iteration: int) -> None:
    """What a train job leaves under its save: the DCP tracker, a complete iter_* and the owner marker."""
    state = save / owner.STATE_DIR
    (state / f"iter_{iteration:07d}").mkdir(parents=True)
    (state / f"iter_{iteration:07d}" / owner.META).write_text("{}")
    (state / owner.TRACKER).write_text(str(iteration))
    owner.claim(save, job_id, "sweep-1", None)


def register_host(settings: Settings, devices: int) -> None:
    with session_scope(settings.database_url) as session:
        session.add(Host(name="cpu1", device_type="cpu", devices=devices, queue="host.cpu1", address="127.0.0.1"))


def train(**extra: Any) -> dict[str, Any]:
    return {"kind": "train", "data_path": "ds", "load": "hf", "train_iters": 10, "lr": 1e-4, "seq_length": 64, **extra}


YARN = {"rope_scaling_type": "yarn", "rope_scaling_factor": 4.0, "rope_scaling_original_max_position_embeddings": 2048}
PREPROCESS = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o/x"}
EVAL = {"kind": "eval", "load": "hf", "eval_data_path": "in.jsonl", "tokenizer_name_or_path": "tok"}
SERVE = {"kind": "serve", "load": "hf", "tokenizer_name_or_path": "tok"}
CONVERT = {"kind": "convert", "load_model_type": "hf", "save_model_type": "mg", "load_dir": "hf", "save_dir": "o"}


def pipeline(*specs: dict[str, Any], names: tuple[str, ...] = ("prep", "tune", "score")) -> dict[str, Any]:
    return {"kind": "pipeline", "steps": [{"name": n, "spec": s} for n, s in zip(names, specs)]}


# (what the user did, body, field named, words of the message)
MISTAKES: list[tuple[str, dict[str, Any], str, str]] = [
    ("train_iters as a string", train(train_iters="20"), "train_iters", "expected an integer, got the string '20'"),
    ("lr as a string", train(lr="3e-3"), "lr", "expected a number, got the string '3e-3'"),
    ("finetune as a string", train(finetune="yes"), "finetune", "expected true or false"),
    ("bf16 as the string 'true'", train(bf16="true"), "bf16", "expected true or false"),
    ("lora_r as a string", train(lora_r="8"), "lora_r", "expected an integer"),
    ("train_iters fractional", train(train_iters=20.5), "train_iters", "integer"),
    ("nproc_per_node as a string", train(resources={"nproc_per_node": "2"}), "resources.nproc_per_node", "integer"),
    ("resources.gpus", train(resources={"gpus": 1}), "resources.gpus", "did you mean 'nproc_per_node'"),
    ("resources.num_nodes", train(resources={"num_nodes": 1}), "resources.num_nodes", "did you mean 'nnodes'"),
    ("nproc_per_node at the top", train(nproc_per_node=1), "nproc_per_node", "'resources.nproc_per_node'"),
    ("device_type gpu", train(resources={"device_type": "gpu"}), "resources.device_type", "'cpu', 'cuda' or 'npu'"),
    ("cuda on a cpu-only cluster", train(resources={"device_type": "cuda"}), "resources.device_type", "no cuda host"),
    (
        "64 ranks on a 4-slot host",
        train(resources={"nproc_per_node": 64}, global_batch_size=8),
        "resources.nproc_per_node",
        "largest cpu host has 4",
    ),
    ("two nodes, one host", train(resources={"nnodes": 2}), "resources.nnodes", "only 1 cpu hosts"),
    ("learning_rate", train(learning_rate=1e-4), "learning_rate", "did you mean 'lr'"),
    ("max_steps", train(max_steps=10), "max_steps", "did you mean 'train_iters'"),
    ("batch_size", train(batch_size=8), "batch_size", "did you mean 'global_batch_size'"),
    ("seq_lenght typo", train(seq_lenght=64), "seq_lenght", "did you mean 'seq_length'"),
    ("a MindSpeed flag spelling", train(**{"--train-iters": 10}), "--train-iters", "did you mean 'train_iters'"),
    ("output_dir", train(output_dir="o"), "output_dir", "did you mean 'save'"),
    ("an ignored MindSpeed flag", train(**{"use-flash-attn": True}), "use-flash-attn", "no effect in this engine"),
    ("kind typo", train(kind="trian"), "kind", "did you mean 'train'"),
    (
        "a model of a family the engine does not run",
        {**CONVERT, "load_dir": "llama"},
        "load_dir",
        "model_type 'llama' is not a supported model family (qwen3, qwen3_moe)",
    ),
    ("training a llama checkpoint", train(load="llama"), "load", "model_type 'llama' is not a supported model family"),
    ("kind missing", {k: v for k, v in train().items() if k != "kind"}, "kind", "is required"),
    ("lora_alpha without lora_r", train(lora_alpha=16), "lora_alpha", "lora_r (the LoRA rank"),
    ("lora targets without lora_r", train(lora_target_modules=["linear_qkv"]), "lora_target_modules", "LoRA only"),
    ("seq_length over the model's positions", train(seq_length=65536), "seq_length", "2048 positions"),
    (
        "seq_length over the spec's positions",
        train(
            load=None,
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            padded_vocab_size=128,
            max_position_embeddings=128,
            seq_length=256,
        ),
        "seq_length",
        "128 positions",
    ),
    (
        "save holding another job's run",
        train(save="runs/old"),
        "save",
        "run of job job-old ('sweep-1') at iteration 20",
    ),
    (
        "resume auto with nothing left",
        train(save="runs/old", resume="auto", train_iters=20),
        "train_iters",
        "leaves nothing to train",
    ),
    ("resume yes", train(resume="yes"), "resume", "'auto'"),
    ("save is the data area itself", train(save="."), "save", "your data area itself"),
    ("save outside the area", train(save="/etc/llmjobs"), "save", "outside your data area"),
    ("data_path climbing out", train(data_path="../x"), "data_path", "must not contain '..'"),
    ("data_path not preprocessed", train(data_path="raw"), "data_path", "preprocess the data first"),
    ("data_path with blend weights", train(data_path="0.5 ds 0.5 ds"), "data_path", "blending weights"),
    ("load missing", train(load="missing"), "load", "is not a directory"),
    ("load an empty directory", train(load="empty"), "load", "holds no model"),
    ("no load and no shape", train(load=None), "num_layers", "required when no checkpoint is loaded"),
    (
        "no vocab source",
        train(load=None, num_layers=2, hidden_size=64, num_attention_heads=4),
        "padded_vocab_size",
        "vocab source",
    ),
    ("tokenizer missing", train(tokenizer_name_or_path="nope"), "tokenizer_name_or_path", "is not a directory"),
    ("tokenizer is a file", train(tokenizer_name_or_path="in.jsonl"), "tokenizer_name_or_path", "is not a directory"),
    (
        "seq_length missing",
        {k: v for k, v in train().items() if k != "seq_length"},
        "seq_length",
        "required for training",
    ),
    (
        "TP not dividing the heads",
        train(tensor_model_parallel_size=4, resources={"nproc_per_node": 4}),
        "tensor_model_parallel_size",
        "6 heads",
    ),
    (
        "PP not dividing the layers",
        train(pipeline_model_parallel_size=2, resources={"nproc_per_node": 2}),
        "pipeline_model_parallel_size",
        "3 layers",
    ),
    (
        "EP on a dense model",
        train(expert_model_parallel_size=2, resources={"nproc_per_node": 2}),
        "expert_model_parallel_size",
        "dense",
    ),
    (
        "global batch not a multiple",
        train(global_batch_size=3, micro_batch_size=2),
        "global_batch_size",
        "not divisible",
    ),
    ("bf16 and fp16", train(bf16=True, fp16=True), "bf16", "at most one"),
    ("WSD decay", train(lr_decay_style="WSD"), "lr_decay_style", "not supported"),
    ("unknown decay style", train(lr_decay_style="cosine_annealing"), "lr_decay_style", "cosine"),
    ("zero iterations", train(train_iters=0), "train_iters", "greater than or equal to 1"),
    ("negative lr", train(lr=-1.0), "lr", "greater than"),
    ("zero micro batch", train(micro_batch_size=0), "micro_batch_size", "greater than or equal to 1"),
    ("keep_last_n without save_interval", train(keep_last_n=2), "keep_last_n", "set save_interval"),
    ("keep_best_by without keep_last_n", train(keep_best_by="lm_loss"), "keep_best_by", "needs keep_last_n"),
    ("train_iters over the ceiling", train(train_iters=20_000), "train_iters", "max_train_iters"),
    ("metadata value a number", train(metadata={"sweep": 1}), "metadata.sweep", "valid string"),
    ("priority out of range", train(priority=1000), "priority", "less than or equal to 100"),
    ("negative max_restarts", train(max_restarts=-1), "max_restarts", "greater than or equal to 0"),
    ("zero run deadline", train(run_deadline_s=0), "run_deadline_s", "greater than 0"),
    ("preprocess input missing", {**PREPROCESS, "input": "nope.jsonl"}, "input", "does not exist"),
    (
        "preprocess tokenizer missing",
        {**PREPROCESS, "tokenizer_name_or_path": "nope"},
        "tokenizer_name_or_path",
        "is not a directory",
    ),
    ("preprocess output is the area", {**PREPROCESS, "output_prefix": "."}, "output_prefix", "your data area itself"),
    ("eval data missing", {**EVAL, "eval_data_path": "nope.jsonl"}, "eval_data_path", "does not exist"),
    (
        "eval without a tokenizer",
        {k: v for k, v in EVAL.items() if k != "tokenizer_name_or_path"},
        "tokenizer_name_or_path",
        "holds no tokenizer",
    ),
    ("eval seq_length over the positions", {**EVAL, "seq_length": 65536}, "seq_length", "2048 positions"),
    (
        "convert mg from an HF directory",
        {**CONVERT, "load_model_type": "mg", "save_model_type": "hf"},
        "load_model_type",
        "is an HF model directory",
    ),
    ("convert load_dir missing", {**CONVERT, "load_dir": "nope"}, "load_dir", "is not a directory"),
    ("convert save type safetensors", {**CONVERT, "save_model_type": "safetensors"}, "save_model_type", "'hf' or 'mg'"),
    (
        "pipeline step with learning_rate",
        pipeline(PREPROCESS, train(learning_rate=1)),
        "steps.1.spec.learning_rate",
        "did you mean 'lr'",
    ),
    (
        "pipeline step train_iters string",
        pipeline(PREPROCESS, train(train_iters="20")),
        "steps.1.spec.train_iters",
        "expected an integer",
    ),
    (
        "pipeline nested",
        pipeline(PREPROCESS, {"kind": "pipeline", "steps": []}),
        "steps.1.spec.kind",
        "pipelines do not nest",
    ),
    (
        "pipeline duplicate step name",
        pipeline(PREPROCESS, PREPROCESS, names=("prep", "prep")),
        "steps.1.name",
        "already the name",
    ),
    (
        "pipeline reference to a later step",
        pipeline(train(data_path="${steps.prep.outputs.data_path}"), PREPROCESS, names=("tune", "prep")),
        "steps.0.spec.data_path",
        "does not run before",
    ),
    (
        "pipeline reference to no step",
        pipeline(PREPROCESS, train(data_path="${steps.prepp.outputs.data_path}")),
        "steps.1.spec.data_path",
        "unknown step 'prepp' (steps: prep, tune); did you mean 'prep'?",
    ),
    (
        "pipeline output key typo",
        pipeline(CONVERT, train(load="${steps.tomg.outputs.chekpoint}"), names=("tomg", "tune")),
        "steps.1.spec.load",
        "step 'tomg' (convert) has no output 'chekpoint'; its outputs are checkpoint; did you mean 'checkpoint'?",
    ),
    (
        "pipeline output of another kind",
        pipeline(PREPROCESS, train(load="${steps.prep.outputs.checkpoint}")),
        "steps.1.spec.load",
        "step 'prep' (preprocess) has no output 'checkpoint'",
    ),
    (
        "pipeline hf output without save_hf",
        pipeline(train(), {**EVAL, "load": "${steps.tune.outputs.hf}"}, names=("tune", "score")),
        "steps.1.spec.load",
        "only with save_hf set",
    ),
    ("seq_length over YaRN's reach", train(seq_length=65536, **YARN), "seq_length", "8192 positions YaRN reaches"),
    ("rope_scaling_factor without a type", train(rope_scaling_factor=4.0), "rope_scaling_factor", "only with"),
    (
        "yarn without the original length",
        train(rope_scaling_type="yarn", rope_scaling_factor=4.0),
        "rope_scaling_original_max_position_embeddings",
        "required with rope_scaling_type yarn",
    ),
    ("rope_scaling_type longrope", train(rope_scaling_type="longrope"), "rope_scaling_type", "'yarn'"),
    ("dpo_beta without stage dpo", train(stage="sft", dpo_beta=0.2), "dpo_beta", "applies to stage dpo only"),
    ("stage dpo without pairwise data", train(stage="dpo"), "is_pairwise_dataset", "trains on preference pairs"),
    (
        "label smoothing on hinge",
        train(stage="dpo", is_pairwise_dataset=True, dpo_loss_type="hinge", dpo_label_smoothing=0.1),
        "dpo_label_smoothing",
        "sigmoid only",
    ),
    (
        "stage dpo under PP 2 with a frozen reference",
        train(stage="dpo", is_pairwise_dataset=True, pipeline_model_parallel_size=2, resources={"nproc_per_node": 2}),
        "pipeline_model_parallel_size",
        "needs precompute_ref_log_probs true (or a reference-free loss",
    ),
    (
        "stage dpo on instruction data",
        train(stage="dpo", is_pairwise_dataset=True),
        "data_path",
        "is_pairwise_dataset: no",
    ),
    (
        "serve max_model_len over the positions",
        {**SERVE, "max_model_len": 8192},
        "max_model_len",
        "model's 2048 positions",
    ),
    ("serve micro_batch_size", {**SERVE, "micro_batch_size": 8}, "micro_batch_size", "did you mean 'max_num_seqs'"),
    ("serve max_batch_size", {**SERVE, "max_batch_size": 8}, "max_batch_size", "did you mean 'max_num_seqs'"),
    ("serve seq_length", {**SERVE, "seq_length": 4096}, "seq_length", "did you mean 'max_model_len'"),
    ("serve hidden_dropout", {**SERVE, "hidden_dropout": 0.1}, "hidden_dropout", "a training field"),
    (
        "serve adapter holding full weights",
        {**SERVE, "lora_adapters": {"tuned": "full"}},
        "lora_adapters.tuned",
        "holds full weights, not LoRA adapters",
    ),
    (
        "serve adapter that does not exist",
        {**SERVE, "lora_adapters": {"tuned": "nope"}},
        "lora_adapters.tuned",
        "does not exist",
    ),
    ("serve load of adapters alone", {**SERVE, "load": "lora-save"}, "load", "give the base model in load"),
    ("eval load of adapters alone", {**EVAL, "load": "lora-save"}, "load", "this checkpoint in lora_load"),
    ("eval lora_load holding full weights", {**EVAL, "lora_load": "full"}, "lora_load", "holds full weights"),
]


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


@pytest.mark.parametrize(("body", "field", "text"), [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_a_realistic_mistake_is_refused_with_the_field_named(
    sweep: tuple[TestClient, str, Settings], body: dict[str, Any], field: str, text: str
) -> None:
    client, token, settings = sweep
    area = team_dir(settings, "alpha")
    before = _files(area)
    answer = client.post("/v1/jobs", json={k: v for k, v in body.items() if v is not None}, headers=auth(token))
    assert answer.status_code == 422, answer.text
    error = answer.json()
    assert error["field"] == field and text in error["message"], error
    assert error["message"].startswith(f"{field}: ") or error["field"] == "kind", error
    assert client.get("/v1/jobs", headers=auth(token)).json()["data"] == []
    assert _files(area) == before  # nothing left behind


def test_the_sweep_is_sixty_or_more_mistakes() -> None:
    assert len(MISTAKES) >= 60 and len({m[0] for m in MISTAKES}) == len(MISTAKES)


def test_the_real_blocker_comes_first_on_a_one_slot_host(client: TestClient, token: str, settings: Settings) -> None:
    register_host(settings, 1)
    body = train(resources={"nproc_per_node": 64}, global_batch_size=8, micro_batch_size=1)
    answer = client.post("/v1/jobs", json=body, headers=auth(token))
    assert answer.status_code == 422 and answer.json()["field"] == "resources.nproc_per_node", answer.text


def test_resume_auto_continues_another_jobs_run_and_a_new_save_is_fine(client: TestClient, token: str) -> None:
    for body in (train(save="runs/old", resume="auto", train_iters=40), train(save="runs/new"), train(resume="auto")):
        answer = client.post("/v1/jobs", json=body, headers=auth(token))
        assert answer.status_code == 201, answer.text


def test_yarn_in_the_spec_or_the_checkpoint_stretches_the_positions(
    client: TestClient, token: str, settings: Settings
) -> None:
    answer = client.post("/v1/jobs", json=train(seq_length=8192, **YARN), headers=auth(token))
    assert answer.status_code == 201, answer.text
    hf = team_dir(settings, "alpha") / "hf" / "config.json"
    config = json.loads(hf.read_text())
    config["rope_scaling"] = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}
    hf.write_text(json.dumps(config))
    assert client.post("/v1/jobs", json=train(seq_length=4096), headers=auth(token)).status_code == 201
    refused = client.post("/v1/jobs", json=train(seq_length=4097), headers=auth(token))
    assert refused.status_code == 422 and "4096 positions YaRN reaches" in refused.json()["message"], refused.text


def test_the_embedded_worker_reports_host_ram_so_a_70b_spec_is_refused(
    client: TestClient, token: str, settings: Settings
) -> None:
    from worker.devices import device_memory_bytes, host_memory_bytes
    from worker.hosts import register_host as register_worker

    assert device_memory_bytes("cpu", 4) == host_memory_bytes() // 4 > 0  # RAM shared by the CPU slots
    register_worker(
        settings,
        name="local",
        device_type="cpu",
        devices=1,
        queues=["host.local"],
        device_memory=device_memory_bytes("cpu"),
    )
    shape = {"num_layers": 80, "hidden_size": 8192, "ffn_hidden_size": 28672, "num_attention_heads": 64}
    body = train(
        load=None, **shape, group_query_attention=True, num_query_groups=8, padded_vocab_size=152064, seq_length=4096
    )
    answer = client.post("/v1/jobs", json=body, headers=auth(token))
    assert answer.status_code == 422 and answer.json()["code"] == "does_not_fit", answer.text
    assert client.get("/v1/jobs", headers=auth(token)).json()["data"] == []


def test_the_docs_table_lists_every_mistake() -> None:
    table = (Path(__file__).resolve().parents[3] / "docs" / "submission-mistakes.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[1] for row in rows] == [m[0] for m in MISTAKES]
