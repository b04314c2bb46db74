"""Clear refusals (issue 17 item 7): a LoRA-only checkpoint given as the base, an unsupported handler_name, and a
pairwise (DPO) file under the instruction handler (corpus ``tests/corpus/pairwise_sharegpt.jsonl`` /
``pairwise_alpaca.jsonl``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from convert_tiny import tiny_hf
from engine.checkpoint.hf import HFCheckpoint
from engine.checkpoint.job import run as convert
from engine.checkpoint.megatron_write import save_mcore
from engine.contract.runfiles import BadInput, RunDir
from engine.contract.spec import ConvertSpec, PreprocessSpec
from engine.preprocess import run as preprocess

CORPUS = Path(__file__).resolve().parents[3] / "corpus"


def test_lora_only_checkpoint_as_base_names_load_dir_and_lora_load(tmp_path):
    src = HFCheckpoint(tiny_hf(tmp_path / "hf", tied=True, layers=2))
    save_mcore(src, src.config, tmp_path / "base", tp=1, pp=1)
    shutil.copytree(tmp_path / "base", tmp_path / "lora")
    path = tmp_path / "lora" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    hidden = src.config.hidden_size
    state["model"] = {  # what MindSpeed's --lora-ckpt-filter keeps: the lora keys (and None extra states)
        "decoder.layers.0.mlp.linear_fc2.lora_A.default.weight": torch.zeros(2, src.config.ffn_hidden_size),
        "decoder.layers.0.mlp.linear_fc2.lora_B.default.weight": torch.zeros(hidden, 2),
        "decoder.layers.0.mlp.linear_fc2._extra_state": None,
    }
    torch.save(state, path)
    spec = ConvertSpec(
        load_model_type="mg",
        save_model_type="hf",
        load_dir=str(tmp_path / "lora"),
        save_dir=str(tmp_path / "out"),
        save_lora_to_hf=True,
        lora_r=2,
        lora_alpha=4,
    )
    with pytest.raises(BadInput, match="give the base model as load_dir and the adapters as lora_load") as err:
        convert(spec, RunDir(tmp_path / "run"))
    assert err.value.field == "load_dir"


def test_unsupported_handler_is_a_short_field_error(tmp_path):
    with pytest.raises(ValidationError) as err:
        PreprocessSpec(
            input=str(tmp_path),
            tokenizer_name_or_path=str(tmp_path),
            output_prefix=str(tmp_path / "o"),
            handler_name="MOSSInstructionHandler",
            prompt_type="qwen3",
            map_keys={"prompt": "q"},
            seq_length=64,
        )
    text = str(err.value)
    assert "handler_name: 'MOSSInstructionHandler' is not supported; use one of SharegptStyleInstructionHandler" in text
    assert err.value.errors()[0]["loc"] == ("handler_name",)
    assert "map_keys" not in text and "tokenizer_name_or_path" not in text  # not the whole spec dumped


@pytest.mark.parametrize(
    ("name", "handler", "pairwise"),
    [
        ("pairwise_sharegpt.jsonl", "SharegptStyleInstructionHandler", "SharegptStylePairwiseHandler"),
        ("pairwise_alpaca.jsonl", "AlpacaStyleInstructionHandler", "AlpacaStylePairwiseHandler"),
    ],
)
def test_pairwise_rows_under_the_instruction_handler_name_the_pairwise_handler(
    tmp_path, qwen_tokenizer_dir, name, handler, pairwise
):
    spec = PreprocessSpec(
        input=str(CORPUS / name),
        tokenizer_name_or_path=str(qwen_tokenizer_dir),
        output_prefix=str(tmp_path / "o"),
        handler_name=handler,
        prompt_type="qwen3",
    )
    with pytest.raises(BadInput, match=f"line 1: a pairwise .* preprocess it with handler_name {pairwise}"):
        preprocess(spec, RunDir(tmp_path / "run"))
