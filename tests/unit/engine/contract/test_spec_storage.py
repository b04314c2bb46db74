"""The stored form of a spec keeps what the user set, so the engine can tell an explicit flag from a default."""

from engine.contract.spec import parse_spec, spec_to_json


def test_stored_spec_keeps_only_set_fields_plus_kind_and_resources():
    spec = parse_spec(
        {
            "kind": "train",
            "data_path": "d",
            "train_iters": 3,
            "lr": 1e-3,
            "load": "ckpt",
            "resources": {"nproc_per_node": 2},
        }
    )
    stored = spec_to_json(spec)
    # Megatron's generic defaults (LayerNorm, rotary base 10000, ...) must not look like user choices: a shape left
    # unset comes from the checkpoint's config.json.
    assert "normalization" not in stored and "rotary_base" not in stored and "num_layers" not in stored
    assert stored["kind"] == "train"
    assert stored["resources"] == {"device_type": "cpu", "nnodes": 1, "nproc_per_node": 2}
    again = parse_spec(stored)
    assert again.model_fields_set == spec.model_fields_set | {"kind", "resources"}
    assert again == spec


def test_stored_spec_keeps_resolved_paths(tmp_path):
    (tmp_path / "data").mkdir()
    spec = parse_spec(
        {"kind": "preprocess", "input": "data", "tokenizer_name_or_path": "tok", "output_prefix": "out/x"},
        data_roots=[str(tmp_path)],
    )
    stored = spec_to_json(spec)
    assert stored["input"] == str((tmp_path / "data").resolve())
    assert stored["resources"]["device_type"] == "cpu"
