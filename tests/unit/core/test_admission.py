"""Admission: what the engine would refuse before its first step is a 422 naming the field at submission."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from core.admission import suggest
from core.settings import Settings
from core_support import auth, isolated_settings, make_token, team_dir


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return _settings(tmp_path)


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, str]]:
    """One service and alpha's token for the tests whose every submission is refused: a refusal stores nothing, so
    they share it (test_refused_before_any_worker checks after each that alpha still has no job)."""
    settings = _settings(tmp_path_factory.mktemp("refusing"))
    with TestClient(create_app(settings, reconcile=False)) as client:
        yield client, make_token(settings, "alpha")


def _settings(var: Path) -> Settings:
    settings = isolated_settings(
        var,
        max_train_iters=10_000,
        max_train_tokens=10**9,
        default_run_deadline_s=3600,
        team_run_deadlines="beta=60",
    )
    for team in ("alpha", "beta"):
        _inputs(team_dir(settings, team))
    return settings


def _inputs(data: Path) -> None:
    (data / "in.jsonl").write_text('{"text": "hi"}\n')
    (data / "tok").mkdir()
    (data / "tok" / "tokenizer.json").write_text("{}")
    for suffix in (".bin", ".idx"):
        (data / f"ds_packed_input_ids_document{suffix}").write_bytes(b"")
    for field in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"):
        for suffix in (".bin", ".idx"):
            (data / f"pairs_packed_{field}_document{suffix}").write_bytes(b"")
    (data / "hf").mkdir()
    (data / "hf" / "config.json").write_text(
        json.dumps({"num_attention_heads": 6, "num_key_value_heads": 2, "num_hidden_layers": 3})
    )
    (data / "hf" / "model.safetensors").write_bytes(b"")
    (data / "moe").mkdir()  # a Qwen3-MoE as transformers 5 writes it: the expert count as num_local_experts
    (data / "moe" / "config.json").write_text(
        json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "num_local_experts": 4})
    )
    (data / "moe" / "model.safetensors").write_bytes(b"")
    (data / "broken").mkdir()
    (data / "broken" / "config.json").write_text("{not json")
    (data / "empty").mkdir()


def train(**extra: Any) -> dict[str, Any]:
    return {"kind": "train", "data_path": "ds", "load": "hf", "train_iters": 10, "lr": 1e-4, "seq_length": 64, **extra}


def refused(client: TestClient, token: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = client.post("/v1/jobs", json=body, headers=auth(token))
    assert answer.status_code == 422, answer.text
    error = answer.json()
    assert error["code"] == "validation_error" and error["errors"][0]["field"] == error["field"]
    assert "Value error" not in error["message"]
    return error


def test_a_dpo_spec_on_pairwise_data_is_accepted(client: TestClient, token: str) -> None:
    body = train(stage="dpo", is_pairwise_dataset=True, data_path="pairs", ref_model="hf")
    answer = client.post("/v1/jobs", json=body, headers=auth(token))
    assert answer.status_code == 201, answer.text


def test_openais_dpo_method_is_mapped_onto_mindspeeds_fields(client: TestClient, token: str) -> None:
    """Issue 26: OpenAI's fine-tuning request shape on a train body: ``method.type`` dpo with its beta and batch
    size becomes stage dpo, is_pairwise_dataset, dpo_beta and global_batch_size; "auto" keeps our defaults."""
    hyper = {"beta": 0.25, "batch_size": 4, "n_epochs": "auto", "learning_rate_multiplier": "auto"}
    body = train(data_path="pairs", ref_model="hf", method={"type": "dpo", "dpo": {"hyperparameters": hyper}})
    answer = client.post("/v1/jobs", json=body, headers=auth(token))
    assert answer.status_code == 201, answer.text
    spec = answer.json()["spec"]
    assert (spec["stage"], spec["is_pairwise_dataset"], spec["dpo_beta"], spec["global_batch_size"]) == (
        "dpo",
        True,
        0.25,
        4,
    )
    supervised = client.post("/v1/jobs", json=train(method={"type": "supervised"}), headers=auth(token))
    assert supervised.status_code == 201 and supervised.json()["spec"].get("stage") in (None, "sft"), supervised.text


@pytest.mark.parametrize(
    ("method", "extra", "field"),
    [
        ({"type": "reinforcement"}, {}, "method.type"),
        ({"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 3}}}, {}, "method.dpo.hyperparameters.n_epochs"),
        ({"type": "dpo", "dpo": {"hyperparameters": {"beta": "high"}}}, {}, "method.dpo.hyperparameters.beta"),
        ({"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2}}}, {"dpo_beta": 0.3}, "method"),
        ({"type": "supervised"}, {"stage": "dpo", "is_pairwise_dataset": True}, "method"),
        ({"type": "dpo", "supervised": {}}, {}, "method.supervised"),
    ],
)
def test_bad_openai_methods_name_the_field(
    refusing: tuple[TestClient, str], method: dict, extra: dict, field: str
) -> None:
    client, token = refusing
    answer = client.post("/v1/jobs", json=train(data_path="pairs", method=method, **extra), headers=auth(token))
    assert answer.status_code == 422 and answer.json()["field"] == field, answer.text


def test_a_good_train_spec_is_accepted_with_the_default_deadline(client: TestClient, token: str) -> None:
    answer = client.post("/v1/jobs", json=train(), headers=auth(token))
    assert answer.status_code == 201, answer.text
    assert answer.json()["spec"]["run_deadline_s"] == 3600


def test_expert_parallel_train_on_a_transformers_moe_checkpoint_is_accepted(client: TestClient, token: str) -> None:
    body = train(load="moe", expert_model_parallel_size=2, resources={"nproc_per_node": 2})
    answer = client.post("/v1/jobs", json=body, headers=auth(token))
    assert answer.status_code == 201, answer.text


def test_a_team_deadline_overrides_the_default_and_a_spec_overrides_both(
    client: TestClient, settings: Settings
) -> None:
    from core_support import make_token

    beta = make_token(settings, "beta")
    assert client.post("/v1/jobs", json=train(), headers=auth(beta)).json()["spec"]["run_deadline_s"] == 60
    own = client.post("/v1/jobs", json=train(run_deadline_s=5), headers=auth(beta)).json()
    assert own["spec"]["run_deadline_s"] == 5


def test_pipeline_steps_get_the_team_deadline_unless_they_set_their_own(client: TestClient, settings: Settings) -> None:
    from core_support import make_token

    beta = make_token(settings, "beta")
    prep = {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "out/p"}
    for own, expected in ((None, 60), (5, 5)):
        step = {**prep, **({"run_deadline_s": own} if own else {})}
        body = {"kind": "pipeline", "steps": [{"name": "prep", "spec": step}]}
        made = client.post("/v1/jobs", json=body, headers=auth(beta))
        assert made.status_code == 201, made.text
        assert "run_deadline_s" not in made.json()["spec"]  # the pipeline itself runs its steps, not a process
        children = client.get("/v1/jobs", params={"parent_id": made.json()["id"]}, headers=auth(beta)).json()
        assert [c["spec"]["run_deadline_s"] for c in children["data"]] == [expected]


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        ({**train(), "seq_length": None}, "seq_length", "required for training"),
        (train(load=None), "num_layers", "required when no checkpoint is loaded"),
        (train(load=None, num_layers=2, hidden_size=64, num_attention_heads=4), "padded_vocab_size", "vocab source"),
        (train(data_path="nothing"), "data_path", "no indexed dataset for prefix"),
        (
            train(stage="dpo", is_pairwise_dataset=True),
            "data_path",
            "is_pairwise_dataset: no",  # ds holds instruction data, not chosen/rejected pairs
        ),
        (
            train(stage="dpo", is_pairwise_dataset=True, data_path="pairs", ref_model="empty"),
            "ref_model",
            "holds no model",
        ),
        (train(tokenizer_name_or_path="missing"), "tokenizer_name_or_path", "is not a directory"),
        (train(load="empty"), "load", "holds no model"),
        (train(load="broken"), "load", "not readable JSON"),
        (train(load="missing"), "load", "is not a directory"),
        (train(tensor_model_parallel_size=4, resources={"nproc_per_node": 4}), "tensor_model_parallel_size", "6 heads"),
        (
            train(tensor_model_parallel_size=3, resources={"nproc_per_node": 3}),
            "tensor_model_parallel_size",
            "2 KV heads",
        ),
        (
            train(pipeline_model_parallel_size=2, resources={"nproc_per_node": 2}),
            "pipeline_model_parallel_size",
            "3 layers",
        ),
        (
            train(expert_model_parallel_size=2, resources={"nproc_per_node": 2}),
            "expert_model_parallel_size",
            "the model is dense",
        ),
        (
            train(expert_model_parallel_size=2, num_experts=3, resources={"nproc_per_node": 2}),
            "expert_model_parallel_size",
            "does not divide the model's 3 experts",
        ),
        (
            train(load="moe", expert_model_parallel_size=3, resources={"nproc_per_node": 3}),
            "expert_model_parallel_size",
            "does not divide the model's 4 experts",
        ),
        (train(train_iters=10**14), "train_iters", "max_train_iters"),
        (train(train_iters=10_000, seq_length=100_000, global_batch_size=8), "train_iters", "max_train_tokens"),
        (train(lr_decay_style="WSD"), "lr_decay_style", "not supported"),
        (
            {"kind": "preprocess", "input": "nope.jsonl", "tokenizer_name_or_path": "tok", "output_prefix": "o/x"},
            "input",
            "does not exist",
        ),
        (
            {"kind": "preprocess", "input": "in.jsonl", "tokenizer_name_or_path": "nope", "output_prefix": "o/x"},
            "tokenizer_name_or_path",
            "is not a directory",
        ),
        (
            {"kind": "eval", "load": "hf", "eval_data_path": "nope.jsonl", "tokenizer_name_or_path": "tok"},
            "eval_data_path",
            "does not exist",
        ),
        ({"kind": "eval", "load": "hf", "eval_data_path": "in.jsonl"}, "tokenizer_name_or_path", "holds no tokenizer"),
        ({"kind": "serve", "load": "hf"}, "tokenizer_name_or_path", "holds no tokenizer"),
        ({"kind": "serve", "load": "nope", "tokenizer_name_or_path": "tok"}, "load", "is not a directory"),
        (
            {
                "kind": "serve",
                "load": "hf",
                "tokenizer_name_or_path": "tok",
                "tensor_model_parallel_size": 2,
                "resources": {"nproc_per_node": 4},
            },
            "tensor_model_parallel_size",
            "every rank a TP rank",
        ),
        (
            {
                "kind": "serve",
                "load": "hf",
                "tokenizer_name_or_path": "tok",
                "tensor_model_parallel_size": 4,
                "resources": {"nproc_per_node": 4},
            },
            "tensor_model_parallel_size",
            "6 heads",  # the one layout rule, over the checkpoint's shape
        ),
        (
            {"kind": "convert", "load_model_type": "mg", "save_model_type": "hf", "load_dir": "hf", "save_dir": "o"},
            "load_model_type",
            "is an HF model directory",
        ),
        (
            {"kind": "convert", "load_model_type": "hf", "save_model_type": "mg", "load_dir": "nope", "save_dir": "o"},
            "load_dir",
            "is not a directory",
        ),
    ],
)
def test_refused_before_any_worker(
    refusing: tuple[TestClient, str], body: dict[str, Any], field: str, text: str
) -> None:
    client, token = refusing
    error = refused(client, token, {k: v for k, v in body.items() if v is not None})
    assert error["field"] == field and text in error["message"], error
    assert client.get("/v1/jobs", headers=auth(token)).json()["data"] == []


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("train-iters", "train_iters"),
        ("--train-iters", "train_iters"),
        ("learning_rate", "lr"),
        ("seq_lenght", "seq_length"),
        ("tensor-model-parallel-size", "tensor_model_parallel_size"),
    ],
)
def test_unknown_fields_say_what_was_meant(refusing: tuple[TestClient, str], name: str, meant: str) -> None:
    client, token = refusing
    error = refused(client, token, {**train(), name: 1})
    assert error["field"] == name and f"did you mean {meant!r}" in error["message"], error


def test_unknown_resources_field_and_ignored_mindspeed_flag(refusing: tuple[TestClient, str]) -> None:
    client, token = refusing
    error = refused(client, token, train(resources={"nproc-per-node": 1}))
    assert error["field"] == "resources.nproc-per-node" and "'nproc_per_node'" in error["message"]
    error = refused(client, token, {**train(), "use-flash-attn": True})
    assert "no effect in this engine" in error["message"]


def test_a_kind_typo_lists_the_kinds(refusing: tuple[TestClient, str]) -> None:
    client, token = refusing
    error = refused(client, token, {**train(), "kind": "trian"})
    assert error["field"] == "kind" and "did you mean 'train'" in error["message"]
    assert "preprocess, convert, train, eval, serve, pipeline" in error["message"]


def test_an_unknown_state_filter_is_refused_like_an_unknown_kind(refusing: tuple[TestClient, str]) -> None:
    client, token = refusing
    for query, field in [("state=runing", "state"), ("kind=trian", "kind")]:
        answer = client.get(f"/v1/jobs?{query}", headers=auth(token))
        assert answer.status_code == 422, answer.text
        assert answer.json()["field"] in (field, f"query.{field}")
    assert client.get("/v1/jobs?state=running,queued", headers=auth(token)).status_code == 200


def test_pipeline_steps_may_use_what_earlier_steps_write(client: TestClient, token: str) -> None:
    steps = [
        {
            "name": "prep",
            "spec": {
                "kind": "preprocess",
                "input": "in.jsonl",
                "tokenizer_name_or_path": "tok",
                "output_prefix": "new/intent",
                "handler_name": "",
                "seq_length": 64,
            },
        },
        {"name": "lit", "spec": train(data_path="new/intent", save="new/ckpt")},
        {
            "name": "ref",
            "spec": train(data_path="${steps.prep.outputs.data_path}", load="${steps.lit.outputs.checkpoint}"),
        },
    ]
    answer = client.post("/v1/jobs", json={"kind": "pipeline", "steps": steps}, headers=auth(token))
    assert answer.status_code == 201, answer.text
    steps[1]["spec"]["data_path"] = "elsewhere/x"
    error = refused(client, token, {"kind": "pipeline", "steps": steps})
    assert error["field"] == "steps.1.spec.data_path", error
    steps[1]["spec"]["learning_rate"] = 1
    error = refused(client, token, {"kind": "pipeline", "steps": steps})
    assert error["field"] == "steps.1.spec.learning_rate" and "did you mean 'lr'" in error["message"]


def test_suggest_gives_nothing_for_nonsense() -> None:
    assert suggest("zzzzqqq", ["lr", "train_iters"]) is None
