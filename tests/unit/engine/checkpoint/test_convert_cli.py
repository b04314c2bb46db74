"""The seed's three conversion command lines (paths changed) produce the seed's directory layouts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from convert_tiny import hf_logits, read_hf, tiny_hf
from engine.cli import main
from engine.contract.runfiles import EXIT_OK

SEED_COMMON = [
    "--use-mcore-models",
    "--model-type",
    "GPT",
    "--spec",
    "mindspeed_llm.tasks.models.spec.qwen3_spec",
    "layer_spec",
    "--model-type-hf",
    "qwen3",
]


def _run(tmp_path: Path, name: str, *flags: str) -> dict:
    run_dir = tmp_path / "runs" / name
    assert main(["convert", *SEED_COMMON, *flags, "--run-dir", str(run_dir)]) == EXIT_OK, (
        run_dir / "events.jsonl"
    ).read_text()
    return json.loads((run_dir / "result.json").read_text())


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _as_training_save(mg: Path, out: Path, iteration: int) -> Path:
    """What MindSpeed's trainer leaves: tracker N, iter_000000N, _extra_state entries on the parallel linears."""
    shutil.copytree(mg, out)
    (out / "iter_0000001").rename(out / f"iter_{iteration:07d}")
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    for pt in out.rglob("model_optim_rng.pt"):
        state = torch.load(pt, weights_only=False)
        state["iteration"] = iteration
        for key in [k for k in state["model"] if k.endswith(("linear_qkv.weight", "linear_fc2.weight"))]:
            state["model"][key.replace(".weight", "._extra_state")] = None
        torch.save(state, pt)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("seed")
    hf = tiny_hf(root / "models" / "Qwen3-4B", tied=True, dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen_tokenizer_dir / name, hf / name)
    return root


def test_seed_hf2mcore_then_mcore2hf_full(models: Path, tmp_path: Path) -> None:
    hf = models / "models" / "Qwen3-4B"
    mg = tmp_path / "4B" / "mg_weights" / "qwen3_4B_mcore_tp1pp2"
    mg.mkdir(parents=True)  # the seed's script runs mkdir -p first
    result = _run(
        tmp_path,
        "hf2mcore",
        "--load-model-type",
        "hf",
        "--save-model-type",
        "mg",
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "2",
        "--load-dir",
        f"{hf}/",
        "--save-dir",
        f"{mg}/",
        "--tokenizer-model",
        f"{hf}/tokenizer.json",
        "--params-dtype",
        "bf16",
    )
    assert _tree(mg) == [
        "iter_0000001/mp_rank_00_000/model_optim_rng.pt",
        "iter_0000001/mp_rank_00_001/model_optim_rng.pt",
        "latest_checkpointed_iteration.txt",
    ]
    assert result["summary"]["pipeline_parallel"] == 2 and result["outputs"]["checkpoint"] == str(mg)

    saved = _as_training_save(mg, tmp_path / "4B" / "save_weights_full" / "qwen3_4B_mcore_tp1pp2_customed10k", 390)
    target = tmp_path / "models" / "Qwen3-4B"
    shutil.copytree(hf, target)  # save-dir is the original HF folder; the output lands in its mg2hf/
    _run(
        tmp_path,
        "mcore2hf",
        "--load-model-type",
        "mg",
        "--save-model-type",
        "hf",
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "2",
        "--load-dir",
        f"{saved}/",
        "--save-dir",
        f"{target}/",
        "--params-dtype",
        "bf16",
    )
    assert _tree(target / "mg2hf") == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    config = json.loads((target / "mg2hf" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    original, back = read_hf(hf), read_hf(target / "mg2hf")
    assert back.keys() == original.keys() - {"lm_head.weight"}
    assert all(torch.equal(original[k], back[k]) for k in back)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hf_logits(hf, ids), hf_logits(target / "mg2hf", ids))


def test_seed_lora_merge_then_mcore2hf_lora(models: Path, tmp_path: Path) -> None:
    hf = models / "models" / "Qwen3-4B"
    base = tmp_path / "mg" / "qwen3_4B_mcore_tp1pp2"
    _run(
        tmp_path,
        "hf2mcore",
        "--load-model-type",
        "hf",
        "--save-model-type",
        "mg",
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "2",
        "--load-dir",
        str(hf),
        "--save-dir",
        str(base),
        "--params-dtype",
        "bf16",
    )
    # A LoRA run's save: the base under base_layer plus adapters (MindSpeed PEFT names), iteration 800.
    lora = _as_training_save(base, tmp_path / "save_weights_lora" / "qwen3_4B_mcore_tp1pp2_customed10k", 800)
    g = torch.Generator().manual_seed(5)
    adapters = {}
    for stage, pt in enumerate(sorted(lora.rglob("model_optim_rng.pt"))):
        state = torch.load(pt, weights_only=False)
        model = state["model"]
        for key in [k for k in model if k.endswith("mlp.linear_fc2.weight")]:
            module = key.removesuffix(".weight")
            a, b = (
                (0.1 * torch.randn(16, 96, generator=g)).bfloat16(),
                (0.1 * torch.randn(64, 16, generator=g)).bfloat16(),
            )
            model[module + ".base_layer.weight"] = model.pop(key)
            model[module + ".lora_A.default.weight"], model[module + ".lora_B.default.weight"] = a, b
            adapters[stage * 2 + int(key.split(".")[2])] = (a, b)
        torch.save(state, pt)
    merged = tmp_path / "save_weights_lora" / "qwen3_4B_mcore_tp1pp2_customed10k_merge"
    _run(
        tmp_path,
        "merge",
        "--load-model-type",
        "mg",
        "--save-model-type",
        "mg",
        "--load-dir",
        f"{lora}/",
        "--lora-r",
        "16",
        "--lora-alpha",
        "32",
        "--lora-target-modules",
        "linear_qkv",
        "linear_proj",
        "linear_fc1",
        "linear_fc2",
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "1",
        "--save-dir",
        f"{merged}/",
    )
    assert _tree(merged) == ["iter_0000001/mp_rank_00/model_optim_rng.pt", "latest_checkpointed_iteration.txt"]

    target = tmp_path / "models" / "Qwen3-4B_lora"
    shutil.copytree(hf, target)
    _run(
        tmp_path,
        "mcore2hf-lora",
        "--load-model-type",
        "mg",
        "--save-model-type",
        "hf",
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "1",
        "--load-dir",
        f"{merged}/",
        "--save-dir",
        f"{target}/",
    )
    out = read_hf(target / "mg2hf")
    assert _tree(target / "mg2hf")[-1] == "model.safetensors.index.json"
    base_w = read_hf(hf)
    # attention untouched, down_proj moved by exactly alpha/r · B @ A
    assert torch.equal(out["model.layers.1.self_attn.q_proj.weight"], base_w["model.layers.1.self_attn.q_proj.weight"])
    for layer, (a, b) in adapters.items():
        w = base_w[f"model.layers.{layer}.mlp.down_proj.weight"]
        expected = (w.float() + 32 / 16 * (b.float() @ a.float())).bfloat16()
        assert torch.equal(out[f"model.layers.{layer}.mlp.down_proj.weight"], expected)
        assert not torch.equal(expected, w)
    assert out["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16  # no silent fp16 (v1's default)


def test_tokenizer_files_copied_and_progress_reported(models: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = models / "models" / "Qwen3-4B"
    mg = tmp_path / "mg"
    _run(
        tmp_path,
        "to-mg",
        "--load-model-type",
        "hf",
        "--save-model-type",
        "mg",
        "--load-dir",
        str(hf),
        "--save-dir",
        str(mg),
        "--target-tensor-parallel-size",
        "2",
    )
    out = tmp_path / "hf-out"
    _run(
        tmp_path,
        "to-hf",
        "--load-model-type",
        "mg",
        "--save-model-type",
        "hf",
        "--load-dir",
        str(mg),
        "--save-dir",
        str(out),
        "--tokenizer-model",
        str(hf / "tokenizer.json"),
    )
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {p.name for p in out.iterdir()}
    assert AutoTokenizer.from_pretrained(out).encode("hello") == AutoTokenizer.from_pretrained(hf).encode("hello")
    events = [json.loads(line) for line in (tmp_path / "runs" / "to-hf" / "events.jsonl").read_text().splitlines()]
    progress = [e["data"] for e in events if e["type"] == "progress"]
    assert progress and progress[-1]["done"] == progress[-1]["total"] and progress[-1]["unit"] == "tensors"
