"""An expert-parallel rank reads only its experts: ``expert_range`` gives experts lo:hi of a stacked expert tensor
equal to the whole tensor's, read alone from HF and mcore files and drawn alone from the seeded init (the generator
still walks every key in order)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
from moe_support import write_hf_moe_dir  # noqa: E402

from engine.checkpoint.hf import HFCheckpoint  # noqa: E402
from engine.checkpoint.megatron_read import MegatronCheckpoint  # noqa: E402
from engine.checkpoint.megatron_write import save_mcore  # noqa: E402
from engine.checkpoint.sources import ExpertRanges, SeededInit, expert_range  # noqa: E402

KEYS = ("decoder.layers.1.mlp.experts.linear_fc1.weight", "decoder.layers.1.mlp.experts.linear_fc2.weight")


def test_expert_rows_equal_the_whole_tensor_rows(tmp_path: Path) -> None:
    hf = HFCheckpoint(write_hf_moe_dir(tmp_path / "hf"))
    save_mcore(hf, hf.config, tmp_path / "mg")
    mcore = MegatronCheckpoint(tmp_path / "mg")
    assert isinstance(hf, ExpertRanges) and isinstance(mcore, ExpertRanges)
    for source in (hf, mcore):
        for key in KEYS:
            whole = source.get_native(key)
            assert torch.equal(expert_range(source, key, 2, 4), whole[2:4])
            assert torch.equal(expert_range(source, key, 1, 2), whole[1:2])
    # the seeded init: a fresh source per read, asked in model order as a rank asks
    whole = {key: SeededInit(hf.config, 3).get_native(key) for key in KEYS}
    init = SeededInit(hf.config, 3)
    for key in KEYS:
        assert torch.equal(expert_range(init, key, 2, 4), whole[key][2:4])
