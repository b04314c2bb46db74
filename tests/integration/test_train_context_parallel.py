"""Context parallelism (torchrun over gloo) equals one process step by step. Ulysses: CP2 and CP4 on packed samples
(each rank a quarter or half of every packed row; CP4 also over 2 KV groups, each repeated twice), CP2 × DP2 (FSDP over the four ranks), CP2 × TP2 with sequence
parallelism, padded rows. Ring: CP2 and CP4 (a model of 2 KV groups, which Ulysses could not split 4 ways), CP2 × TP2
with sequence parallelism on padded rows without the send/recv overlap. Hybrid: a ring of two Ulysses pairs. MoE
(load-balancing loss on): Ulysses CP2, ring CP2 × TP2 with sequence parallelism. And a
CP2 checkpoint resumed on one process continuing the same loss curve, and the CP2 run's HF export equal to the one
process's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train_support import (
    metric_rows,
    one_process_rows,
    run_train,
    tiny_spec,
    train_in_process,
    write_instruction_data,
)

# KV groups 4 (one query head per group) so CP 4 gets whole groups
FOUR_GROUPS = {"num_attention_heads": 4, "num_query_groups": 4}
LAYOUTS = {
    "cp2": ({"context_parallel_size": 2}, 2),
    "cp4": ({"context_parallel_size": 4, **FOUR_GROUPS}, 4),
    # 2 KV groups over 4 Ulysses ranks: each KV head repeated twice before the all-to-all
    "cp4_kv_repeat": ({"context_parallel_size": 4}, 4),
    "cp2_dp2": ({"context_parallel_size": 2}, 4),
    "cp2_padded": ({"context_parallel_size": 2, "padding_free": False, "variable_seq_lengths": True}, 2),
    "cp2_tp2_sp": (
        {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True, **FOUR_GROUPS},
        4,
    ),
    # the ring: K/V blocks round the ranks, head/tail chunks; any head count (2 KV groups on 4 ranks)
    "ring_cp2": ({"context_parallel_size": 2, "context_parallel_algo": "megatron_cp_algo"}, 2),
    "ring_cp4": ({"context_parallel_size": 4, "context_parallel_algo": "megatron_cp_algo"}, 4),
    "ring_cp2_tp2_sp_padded": (
        {
            "context_parallel_size": 2,
            "context_parallel_algo": "megatron_cp_algo",
            "use_cp_send_recv_overlap": False,
            "tensor_model_parallel_size": 2,
            "sequence_parallel": True,
            "padding_free": False,
            "variable_seq_lengths": True,
        },
        4,
    ),
    # hybrid: Ulysses pairs inside a ring of two
    "hybrid_cp4": (
        {"context_parallel_size": 4, "context_parallel_algo": "hybrid_cp_algo", "ulysses_degree_in_cp": 2},
        4,
    ),
}
# MoE: two routed experts of four per token, the load-balancing loss on; rows padded to seq_length - 1 = 63 tokens,
# which CP pads to 64 itself: that padding is routed but not counted (``MicroBatch.counted``)
MOE = {
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
    "moe_layer_freq": [1, 0],
    "moe_aux_loss_coeff": 0.01,
    "padding_free": False,
    "variable_seq_lengths": False,
}
LAYOUTS.update(
    {
        "moe_cp2": ({"context_parallel_size": 2, **MOE}, 2),
        "moe_cp2_packed": ({"context_parallel_size": 2, **MOE, "padding_free": True}, 2),
        # pipeline × CP: rows padded to one width before they are cut, so no pad lands among a shard's real tokens
        "cp2_pp2": ({"context_parallel_size": 2, "pipeline_model_parallel_size": 2}, 4),
        # MoE in the first stage: CP's padding mask travels with the micro-batches through the schedule
        "moe_cp2_pp2": ({"context_parallel_size": 2, "pipeline_model_parallel_size": 2, **MOE}, 4),
        # experts split over EP 2 of the DP ranks; their gradients sum over EDP × CP
        "moe_cp2_ep2": ({"context_parallel_size": 2, "expert_model_parallel_size": 2, **MOE}, 4),
        "ring_cp2_pp2_padded": (
            {
                "context_parallel_size": 2,
                "context_parallel_algo": "megatron_cp_algo",
                "pipeline_model_parallel_size": 2,
                "padding_free": False,
                "variable_seq_lengths": True,
            },
            4,
        ),
        "moe_ring_cp2_tp2_sp": (
            {
                "context_parallel_size": 2,
                "context_parallel_algo": "megatron_cp_algo",
                "tensor_model_parallel_size": 2,
                "sequence_parallel": True,
                **MOE,
            },
            4,
        ),
    }
)
CP_ONLY = (
    "context_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_algo",
    "ulysses_degree_in_cp",
    "use_cp_send_recv_overlap",
    "tensor_model_parallel_size",
    "sequence_parallel",
    "expert_model_parallel_size",
)


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One dataset for every layout of this module, so equal one-process specs run once (``one_process_rows``)."""
    return write_instruction_data(tmp_path_factory.mktemp("cp-data") / "sft")


def _equal(one: list[dict], many: list[dict]) -> None:
    assert len(one) == len(many) > 0
    for a, b in zip(one, many, strict=True):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["tokens"] == a["tokens"] and b["loss_tokens"] == a["loss_tokens"]
        for key in ("load_balancing_loss", "expert_load_imbalance_max"):  # MoE: routing counted over the CP ranks
            assert (key in b) == (key in a)
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_equals_one_process(tmp_path: Path, shared_data: str, layout: str) -> None:
    extra, nproc = LAYOUTS[layout]
    spec = tiny_spec(shared_data, train_iters=5, use_distributed_optimizer=True)
    one_rank = {**spec, **{k: v for k, v in extra.items() if k not in CP_ONLY}}
    one = one_process_rows(one_rank, tmp_path / "run1")
    run_train({**spec, **extra}, tmp_path / "run_cp", nproc)
    many = metric_rows(tmp_path / "run_cp")
    _equal(one, many)
    parallel = json.loads((tmp_path / "run_cp" / "result.json").read_text())["summary"]["parallel"]
    assert parallel["cp"] == extra["context_parallel_size"]  # the sequences were split, not the batch
    assert parallel["cp_algo"] == extra.get("context_parallel_algo", "ulysses_cp_algo")
    assert parallel["dp"] * parallel["cp"] * parallel["tp"] * parallel.get("pp", 1) == nproc
    assert one[-1]["lm_loss"] < one[0]["lm_loss"]


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_on_one_process(tmp_path: Path) -> None:
    data = write_instruction_data(tmp_path / "data" / "sft")
    spec = tiny_spec(data, train_iters=5, use_distributed_optimizer=True)
    train_in_process({**spec, "save": str(tmp_path / "one"), "save_hf": True}, tmp_path / "run1")
    cp2 = {**spec, "context_parallel_size": 2, "save": str(tmp_path / "cp"), "save_interval": 3, "save_hf": True}
    run_train(cp2, tmp_path / "run2", 2)
    # the CP2 run's HF export: the same files and tensors as the one process's, up to the run's rounding
    files = sorted(p.name for p in (tmp_path / "one" / "hf").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "cp" / "hf").iterdir()) and "config.json" in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert shards
    for name in shards:
        a, b = load_file(tmp_path / "one" / "hf" / name), load_file(tmp_path / "cp" / "hf" / name)
        assert a.keys() == b.keys() and a
        for key, value in a.items():
            torch.testing.assert_close(b[key], value, rtol=0, atol=1e-6)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "cp" / "train_state", resumed / "train_state")
    train_in_process({**spec, "save": str(resumed)}, tmp_path / "run3")  # one process: this one
    one, after = metric_rows(tmp_path / "run1"), metric_rows(tmp_path / "run3")
    assert [r["iteration"] for r in after] == [4, 5]
    _equal(one[3:], after)
