"""``python -m engine trace`` (engine.trace): a small job's step on fake npu tensors, measured beside the planner."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.contract.spec import TrainSpec, parse_spec
from engine.trace.backend import prepare
from engine.trace.cli import trace_spec, traced_ranks

TINY = {
    "num_layers": 2,
    "hidden_size": 128,
    "ffn_hidden_size": 256,
    "num_attention_heads": 4,
    "group_query_attention": True,
    "num_query_groups": 2,
    "kv_channels": 32,
    "padded_vocab_size": 512,
    "untie_embeddings_and_output_weights": True,
}


def tiny_spec(**extra: Any) -> TrainSpec:
    spec = parse_spec(
        {
            "kind": "train",
            "data_path": ["d"],
            "train_iters": 1,
            "lr": 1e-6,
            "bf16": True,
            "seq_length": 128,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "use_distributed_optimizer": True,
            "resources": {"device_type": "npu", "nproc_per_node": 2},
            **TINY,
            **extra,
        }
    )
    assert isinstance(spec, TrainSpec)
    return spec


@pytest.mark.slow
def test_fsdp_dp2_step_traces_on_npu_with_no_host_tensor() -> None:
    """FSDP2 over 2 DP ranks: every tensor of the step on the device, weights/grads/Adam state measured, the
    collectives FSDP issues counted, and the planner's figure beside the trace."""
    out = trace_spec(tiny_spec(), None)
    assert out["host_tensors"] == 0
    rank = out["ranks"][0]
    assert rank["host_syncs"] == {}
    assert {"params", "grads", "optimizer"} <= set(rank["breakdown"])
    assert rank["collective_bytes_per_step"]["all_gather"] > 0
    assert rank["collective_bytes_per_step"]["reduce_scatter"] > 0
    assert rank["peak_bytes"] > 0 and rank["planner_vs_trace"] is not None
    assert out["ranks"][1]["traced_as"] == 0


def test_ranks_of_a_stage_stand_for_each_other() -> None:
    spec = tiny_spec(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, resources={"nproc_per_node": 8})
    from engine.trace.cli import dims_of

    stand_in = traced_ranks(dims_of(spec), all_ranks=False)
    assert sorted(set(stand_in.values())) == [0, 2]  # rank = (dp · PP + pp) · TP + tp
    assert stand_in[7] == 2 and stand_in[4] == 0
    assert traced_ranks(dims_of(spec), all_ranks=True)[7] == 7


@pytest.mark.skipif(torch.cuda._is_compiled(), reason="a CUDA build of torch traces on cuda")
def test_cuda_on_a_cpu_only_torch_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="device_type: tracing on cuda needs a CUDA build"):
        prepare("cuda")
