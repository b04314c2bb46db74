"""Context parallelism's spec rules (refused by field name at submission) and each CP rank's share of a batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from engine.contract.constants import IGNORE_INDEX, PAD_ID
from engine.contract.spec import parse_spec
from engine.train.batches import Sample, context_shard, pack
from train_support import TINY_SHAPE

BASE: dict[str, Any] = {
    "kind": "train",
    "data_path": ["d"],
    "train_iters": 1,
    "lr": 1e-4,
    "seq_length": 64,
    **TINY_SHAPE,
    "micro_batch_size": 1,
    "global_batch_size": 2,
}


def test_cp_takes_its_share_of_the_world() -> None:
    spec = parse_spec({**BASE, "context_parallel_size": 2, "resources": {"nproc_per_node": 4}})
    dims = spec.parallel_dims
    assert (dims.dp, dims.cp, dims.world_size) == (2, 2, 4)


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        (
            {
                "context_parallel_size": 4,
                "kv_head_repeat_before_uly_alltoall": False,
                "resources": {"nproc_per_node": 4},
            },
            "context_parallel_size",
            "2 KV groups (Ulysses) (kv_head_repeat_before_uly_alltoall would repeat them)",
        ),
        ({"context_parallel_size": 8, "resources": {"nproc_per_node": 8}}, "context_parallel_size", "4 heads"),
        ({"context_parallel_size": 2, "resources": {"nproc_per_node": 3}}, "context_parallel_size", "world size"),
        (
            {"context_parallel_size": 4, "context_parallel_algo": "hybrid_cp_algo", "resources": {"nproc_per_node": 4}},
            "ulysses_degree_in_cp",
            "divides context_parallel_size 4 and is below it (got None)",
        ),
        (
            {
                "context_parallel_size": 4,
                "context_parallel_algo": "hybrid_cp_algo",
                "ulysses_degree_in_cp": 4,
                "num_query_groups": 4,
                "resources": {"nproc_per_node": 4},
            },
            "ulysses_degree_in_cp",
            "(got 4)",
        ),
        ({"ulysses_degree_in_cp": 2}, "ulysses_degree_in_cp", "hybrid_cp_algo only"),
        (
            {
                "context_parallel_size": 8,
                "context_parallel_algo": "hybrid_cp_algo",
                "ulysses_degree_in_cp": 4,
                "kv_head_repeat_before_uly_alltoall": False,
                "resources": {"nproc_per_node": 8},
            },
            "ulysses_degree_in_cp",
            "TP 1 × Ulysses degree 4 does not divide the model's 2 KV groups",
        ),
        ({"cp_attention_mask_type": "general"}, "cp_attention_mask_type", "only causal"),
        (
            {
                "context_parallel_size": 4,
                "context_parallel_algo": "hybrid_cp_algo",
                "ulysses_degree_in_cp": 2,
                "expert_model_parallel_size": 2,
                "num_experts": 4,
                "moe_ffn_hidden_size": 32,
                "resources": {"nproc_per_node": 8},
            },
            "expert_model_parallel_size",
            "not supported with hybrid_cp_algo",
        ),
    ],
)
def test_refused_by_name(extra: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({**BASE, **extra})
    assert field in str(err.value) and words in str(err.value), err.value


def test_ulysses_repeats_kv_heads_that_do_not_split() -> None:
    """MindSpeed-LLM's kv_head_repeat_before_uly_alltoall (on by default): 2 KV groups over 4 Ulysses ranks are each
    repeated twice; the least repeat that splits, and it always divides the query group when the heads split."""
    from engine.contract.layout import kv_repeats

    spec = parse_spec({**BASE, "context_parallel_size": 4, "resources": {"nproc_per_node": 4}})
    assert spec.parallel_dims.ulysses_degree == 4
    assert [kv_repeats(kv, 4) for kv in (1, 2, 4, 6, 8)] == [4, 2, 1, 2, 1]
    assert kv_repeats(4, 8) == 2 and kv_repeats(3, 2) == 2
    for heads, kv, u in ((32, 8, 16), (16, 8, 16), (40, 8, 20), (64, 4, 8)):
        assert heads % u == 0 and (heads // kv) % kv_repeats(kv, u) == 0


def test_the_ring_takes_any_head_count() -> None:
    """Four ring ranks over a model of 2 KV groups: no head split, so no head rule (Ulysses would refuse it)."""
    spec = parse_spec(
        {
            **BASE,
            "context_parallel_size": 4,
            "context_parallel_algo": "megatron_cp_algo",
            "resources": {"nproc_per_node": 4},
        }
    )
    dims = spec.parallel_dims
    assert (dims.cp, dims.ring_degree, dims.ulysses_degree) == (4, 4, 1)
    hybrid = {"context_parallel_algo": "hybrid_cp_algo", "ulysses_degree_in_cp": 2}
    dims = parse_spec({**BASE, "context_parallel_size": 4, **hybrid, "resources": {"nproc_per_node": 4}}).parallel_dims
    assert (dims.ring_degree, dims.ulysses_degree) == (2, 2)


def test_ring_and_hybrid_shards_are_head_tail_chunks() -> None:
    """Ring ranks hold chunks r and 2·CP−1−r; under hybrid a ring member's chunks are split among its Ulysses ranks."""
    samples = [Sample(np.arange(1, 12), np.arange(1, 12)), Sample(np.arange(20, 28), np.arange(20, 28))]
    mb = pack(samples, 64)  # 10 + 7 = 17 tokens after the shift, padded to 24 (a multiple of 2 × CP 4)
    ring = [context_shard(mb, 4, 1, rank).position_ids[0].tolist() for rank in range(4)]
    assert ring[0] == [0, 1, 2, 11, 12, 13] and ring[3] == [9, 0, 1, 2, 3, 4]  # chunks 0+7 and 3+4
    hybrid = [context_shard(mb, 2, 2, rank).input_ids[0] for rank in range(4)]
    row = np.pad(mb.input_ids[0].numpy(), (0, 7), constant_values=PAD_ID)
    expect = [np.r_[0:6], np.r_[18:24], np.r_[6:12], np.r_[12:18]]  # members: chunks 0+3, 1+2; halves to ranks
    for rank, cols in enumerate(expect):
        assert hybrid[rank].tolist() == row[cols].tolist()
    parts = [context_shard(mb, 4, 1, rank) for rank in range(4)]
    assert sum(p.num_loss_tokens for p in parts) == mb.num_loss_tokens


def test_each_cp_rank_gets_its_slice_and_the_whole_segments() -> None:
    samples = [Sample(np.arange(1, 6), np.arange(1, 6)), Sample(np.arange(6, 10), np.arange(6, 10))]
    mb = pack(samples, 64)  # one row of 4 + 3 tokens after the shift: 7
    parts = [context_shard(mb, 1, 2, rank) for rank in (0, 1)]
    assert [p.input_ids.shape[1] for p in parts] == [4, 4]  # padded to 8
    whole = torch.cat([p.input_ids for p in parts], dim=1)
    assert whole[0, :7].tolist() == mb.input_ids[0].tolist() and whole[0, 7] == PAD_ID
    labels = torch.cat([p.labels for p in parts], dim=1)
    assert labels[0, :7].tolist() == mb.labels[0].tolist() and labels[0, 7] == IGNORE_INDEX
    assert torch.cat([p.position_ids for p in parts], dim=1)[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    for p in parts:  # attention sees every token: the segments stay whole (the pad joins the last sample)
        assert p.segment_ids is not None and p.segment_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert sum(p.num_loss_tokens for p in parts) == mb.num_loss_tokens
    assert parts[0].seq_lens == mb.seq_lens and parts[1].seq_lens == []  # each sample counted once over CP


def test_parallel_dims_refuse_an_ep_that_does_not_divide_dp_however_built() -> None:
    """The EP rule holds for dims built directly (expert parallelism's own mesh check builds them so), not only
    through ``from_world``."""
    from engine.contract import layout

    with pytest.raises(layout.LayoutError, match="EP 4 must divide the data-parallel size 2") as err:
        layout.ParallelDims(dp=2, ep=4)
    assert err.value.field == "expert_model_parallel_size"
    assert layout.ParallelDims(dp=4, ep=2).ep == 2
