"""`llmjobs run pipeline.json` with no server: the steps run one after another in <run>/<step>/, references resolved
from the earlier steps' result.json; a failed step stops a fail_fast pipeline."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.checkpoint.hf import save_hf
from engine.contract.model_config import preset
from engine.model.qwen3 import Qwen3Model
from worker.foreground import run_foreground

pytestmark = pytest.mark.slow


def write(path: Path, body: dict) -> Path:
    path.write_text(json.dumps(body))
    return path


def test_hf_to_mg_to_hf_pipeline_in_the_foreground(tmp_path: Path) -> None:
    cfg = preset("qwen3-tiny")
    model = Qwen3Model(cfg)
    model.init_weights(seed=0)
    save_hf(model.state_dict(), cfg, tmp_path / "hf", dtype=torch.float32)
    spec = write(
        tmp_path / "p.json",
        {
            "kind": "pipeline",
            "steps": [
                {
                    "name": "tomg",
                    "spec": {
                        "kind": "convert",
                        "load_model_type": "hf",
                        "save_model_type": "mg",
                        "load_dir": str(tmp_path / "hf"),
                        "save_dir": str(tmp_path / "mg"),
                    },
                },
                {
                    "name": "tohf",
                    "spec": {
                        "kind": "convert",
                        "load_model_type": "mg",
                        "save_model_type": "hf",
                        "load_dir": "${steps.tomg.outputs.checkpoint}",
                        "save_dir": str(tmp_path / "back"),
                    },
                },
            ],
        },
    )
    out = io.StringIO()
    assert run_foreground(spec, tmp_path / "run", tmp_path / "runs", out) == 0, out.getvalue()
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert [s["state"] for s in result["summary"]["steps"]] == ["succeeded", "succeeded"]
    assert result["outputs"]["tomg.checkpoint"] == str((tmp_path / "mg").resolve())
    resolved = json.loads((tmp_path / "run" / "tohf.spec.json").read_text())
    assert resolved["load_dir"] == result["outputs"]["tomg.checkpoint"]
    assert (tmp_path / "run" / "tomg" / "result.json").is_file() and (
        tmp_path / "run" / "tohf" / "events.jsonl"
    ).is_file()
    back = Path(result["outputs"]["tohf.checkpoint"])
    before, after = load_file(str(next((tmp_path / "hf").glob("*.safetensors")))), {}
    for shard in back.glob("*.safetensors"):
        after.update(load_file(str(shard)))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_failed_step_stops_a_fail_fast_pipeline(tmp_path: Path) -> None:
    spec = write(
        tmp_path / "p.json",
        {
            "kind": "pipeline",
            "steps": [
                {
                    "name": "tomg",
                    "spec": {
                        "kind": "convert",
                        "load_model_type": "hf",
                        "save_model_type": "mg",
                        "load_dir": str(tmp_path / "no-such-model"),
                        "save_dir": str(tmp_path / "mg"),
                    },
                },
                {
                    "name": "tohf",
                    "spec": {
                        "kind": "convert",
                        "load_model_type": "mg",
                        "save_model_type": "hf",
                        "load_dir": str(tmp_path / "mg"),
                        "save_dir": str(tmp_path / "back"),
                    },
                },
            ],
        },
    )
    out = io.StringIO()
    assert run_foreground(spec, tmp_path / "run", tmp_path / "runs", out) == 1
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert [s["state"] for s in result["summary"]["steps"]] == ["failed", "skipped"]
    assert result["summary"]["error"].startswith("step tomg failed")
    assert not (tmp_path / "run" / "tohf").exists()
