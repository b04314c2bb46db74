"""MindSpeed-LLM's own DPO and SimPO flag blocks run as written: ``--is-instruction-dataset`` beside
``--is-pairwise-dataset`` means pairwise instruction data (read as pairs), and ``--stage simpo`` with its
``--simpo-beta`` / ``--gamma-beta-ratio`` is stage dpo with the simpo loss (margin = ratio × beta)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from engine.contract.flags import spec_from_argv
from engine.contract.spec import TrainSpec

# a tiny model and paths in place of the scripts' (the blocks below are theirs, verbatim)
COMMON = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --padded-vocab-size 256 "
    "--seq-length 64 --micro-batch-size 1 --global-batch-size 8 --train-iters 2 --lr 5e-6 --bf16 "
    "--data-path {data} --load {load} --save {save}"
)
# MindSpeed-LLM docs, Qwen2.5 DPO ("DPO 训练")
QWEN25_DPO = """
--use-mcore-models --finetune --stage dpo --is-pairwise-dataset --is-instruction-dataset --dpo-beta 0.1
--dpo-loss-type sigmoid --prompt-type qwen --tensor-model-parallel-size 1 --no-load-optim --use-flash-attn
"""
# examples/mcore/mixtral/tune_mixtral_8x7b_dpo: GPT_ARGS' --finetune --is-instruction-dataset, then RL_ARGS
MIXTRAL_DPO = """
--no-load-rng --no-shared-storage --finetune --is-instruction-dataset --split 100,0,0
--stage dpo --dpo-loss-type sigmoid --is-pairwise-dataset
"""
# examples/mcore/*/simpo_*: DATA_ARGS (but --data-path) and RL_ARGS
SIMPO = """
--split 100,0,0 --prompt-type empty --is-instruction-dataset --variable-seq-lengths
--finetune --stage simpo --simpo-beta 2.5 --gamma-beta-ratio 1.4 --simpo-loss-type sigmoid --is-pairwise-dataset
--is-instruction-dataset
"""


def _spec(tmp_path: Path, block: str) -> TrainSpec:
    common = COMMON.format(data=tmp_path / "pairs", load=tmp_path / "base", save=tmp_path / "out")
    spec, _, _ = spec_from_argv("train", shlex.split(block) + shlex.split(common))
    assert isinstance(spec, TrainSpec)
    return spec


@pytest.mark.parametrize("block", [QWEN25_DPO, MIXTRAL_DPO], ids=["qwen25-doc", "mixtral-script"])
def test_mindspeed_dpo_lines_run_as_pairwise_data(tmp_path: Path, block: str) -> None:
    spec = _spec(tmp_path, block)
    assert (spec.stage, spec.dpo_loss_type, spec.is_pairwise_dataset) == ("dpo", "sigmoid", True)
    without = _spec(tmp_path, block.replace("--is-instruction-dataset", ""))
    # the instruction flag changes nothing the engine reads (it opens data_path as pairs)
    assert spec.model_dump(exclude={"is_instruction_dataset"}) == without.model_dump(exclude={"is_instruction_dataset"})


def test_mindspeed_simpo_line_is_stage_dpo_with_the_simpo_loss(tmp_path: Path) -> None:
    spec = _spec(tmp_path, SIMPO)
    assert (spec.stage, spec.dpo_loss_type, spec.is_pairwise_dataset) == ("dpo", "simpo", True)
    assert spec.dpo_beta == 2.5 and spec.simpo_gamma == pytest.approx(3.5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--stage simpo --simpo-loss-type hinge --is-pairwise-dataset", "--simpo-loss-type: only sigmoid"),
        ("--stage dpo --gamma-beta-ratio 1.4 --is-pairwise-dataset", "--gamma-beta-ratio: applies to --stage simpo"),
    ],
)
def test_simpo_flags_outside_their_stage_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, message: str
) -> None:
    with pytest.raises(SystemExit):
        _spec(tmp_path, extra)
    assert message in capsys.readouterr().err
