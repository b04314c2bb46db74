"""The loading room's two contracts with its callers: ``decoder_lm`` narrows any family's model (or a pipeline stage
of one) and names what a module that is no language model lacks; ``rank_view`` reads a rank's TP/PP coordinates in
the mesh's order (dp, cp, pp, tp: TP fastest), whatever the CP and DP sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.contract.layout import ParallelDims
from engine.contract.model_config import preset
from engine.contract.spec import TrainSpec
from engine.load.weights import rank_view
from engine.model.decoder_lm import decoder_lm
from engine.model.qwen3 import Qwen3Model


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_decoder_lm_narrows_a_whole_model_and_a_pipeline_stage(name: str) -> None:
    cfg = preset(name)
    with torch.device("meta"):
        whole, middle = Qwen3Model(cfg), Qwen3Model(cfg, layers=[1], embedding=False, head=False)
    assert decoder_lm(whole) is whole
    assert decoder_lm(whole).output_weight().shape == (cfg.vocab_size, cfg.hidden_size)
    assert decoder_lm(middle) is middle
    assert list(decoder_lm(middle).decoder.layers) == ["1"]


def test_decoder_lm_names_what_a_module_lacks() -> None:
    with pytest.raises(TypeError, match=r"Linear is not a DecoderLM \(no cfg, embedding, decoder, .*output_weight\)"):
        decoder_lm(nn.Linear(2, 2))
    half = nn.Module()
    half.cfg = preset("qwen3-tiny")  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"Module is not a DecoderLM \(no embedding,") as err:
        decoder_lm(half)
    assert "cfg" not in str(err.value)


def _spec(tp: int, pp: int, world: int) -> TrainSpec:
    return TrainSpec.model_validate(
        {
            "kind": "train",
            "data_path": ["unused"],
            "train_iters": 1,
            "lr": 1e-3,
            "seq_length": 16,
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "resources": {"nproc_per_node": world},
        }
    )


@pytest.mark.parametrize("dims", [ParallelDims(dp=2, pp=2, tp=2), ParallelDims(dp=1, cp=2, pp=2, tp=2)])
def test_rank_view_reads_the_mesh_coordinates(dims: ParallelDims, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(dims.tp, dims.pp, dims.world_size)
    cfg = preset("qwen3-tiny").replace(num_layers=4)
    for rank in range(dims.world_size):
        view = rank_view(spec, dims, rank)
        # the mesh is row-major over (dp, cp, pp, tp): TP varies fastest, then PP (CP and DP above both)
        assert (view.tp, view.tp_rank, view.pp, view.pp_rank) == (2, rank % 2, 2, (rank // 2) % 2), rank
        keys = view.keys(cfg)
        first, last = view.pp_rank == 0, view.pp_rank == 1
        assert ("embedding.word_embeddings.weight" in keys) == first
        assert ("decoder.final_layernorm.weight" in keys) == last
    monkeypatch.setenv("RANK", "3")  # torchrun's rank when none is given
    assert (rank_view(spec, dims).tp_rank, rank_view(spec, dims).pp_rank) == (1, 1)
