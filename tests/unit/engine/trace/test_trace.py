"""``python -m engine trace`` (engine.trace): a small job's step on fake npu tensors, measured beside the planner."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.contract.spec import ServeSpec, TrainSpec, parse_spec
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
    # the steady step's peak is in forward: last step's gradients were freed by zero_grad(set_to_none=True)
    assert {"params", "activations", "optimizer"} <= set(rank["breakdown"])
    assert rank["collective_bytes_per_step"]["all_gather"] > 0
    assert rank["collective_bytes_per_step"]["reduce_scatter"] > 0
    assert rank["peak_bytes"] > 0 and rank["planner_vs_trace"] is not None
    assert out["ranks"][1]["traced_as"] == 0


def test_ranks_of_a_stage_stand_for_each_other() -> None:
    spec = tiny_spec(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, resources={"nproc_per_node": 8})
    stand_in = traced_ranks(spec.parallel_dims, all_ranks=False)
    assert sorted(set(stand_in.values())) == [0, 2]  # rank = (dp · PP + pp) · TP + tp
    assert stand_in[7] == 2 and stand_in[4] == 0
    assert traced_ranks(spec.parallel_dims, all_ranks=True)[7] == 7


@pytest.mark.skipif(torch.cuda._is_compiled(), reason="a CUDA build of torch traces on cuda")
def test_cuda_on_a_cpu_only_torch_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="device_type: tracing on cuda needs a CUDA build"):
        prepare("cuda")


def _fake_npu(*shape: int, dtype: torch.dtype = torch.bfloat16, grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="npu", requires_grad=grad)


def test_fused_npu_kernels_have_torch_npus_shapes_and_refuse_a_wrong_call() -> None:
    """The stand-in torch_npu's fused kernels are torch.library ops with fake implementations: torch_npu's output
    shapes (softmax max/sum [T, N, 8] fp32 in TND), a backward through their grad ops, and documented checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    prepare("npu")
    import torch_npu

    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k = _fake_npu(12, 4, 32, grad=True), _fake_npu(12, 2, 32, grad=True)
        mask = torch.empty(2048, 2048, dtype=torch.bool, device="npu")
        out, smax, ssum, *_ = torch_npu.npu_fusion_attention(
            q, k, k, 4, "TND", atten_mask=mask, actual_seq_qlen=[5, 12], actual_seq_kvlen=[5, 12], sparse_mode=3
        )
        assert out.shape == q.shape and smax.shape == ssum.shape == (12, 4, 8) and smax.dtype == torch.float32
        out.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape
        with pytest.raises(RuntimeError, match="actual_seq_qlen\\[-1\\] = 11 must equal T = 12"):
            torch_npu.npu_fusion_attention(q, k, k, 4, "TND", actual_seq_qlen=[11], actual_seq_kvlen=[12])
        x = _fake_npu(2, 4, 6, 64, grad=True)
        y, rstd = torch_npu.npu_rms_norm(x, _fake_npu(64), epsilon=1e-6)
        assert y.shape == x.shape and rstd.shape == (2, 4, 6, 1) and rstd.dtype == torch.float32
        with pytest.raises(RuntimeError, match="gamma"):
            torch_npu.npu_rms_norm(x, _fake_npu(64, dtype=torch.float32))
        assert torch_npu.npu_swiglu(x, dim=-1).shape == (2, 4, 6, 32)
        cos = _fake_npu(2, 1, 6, 64)
        assert torch_npu.npu_rotary_mul(x, cos, cos).shape == x.shape
        with pytest.raises(RuntimeError, match="npu_rotary_mul"):
            torch_npu.npu_rotary_mul(x, cos.float(), cos.float())


@pytest.mark.slow
def test_both_pipeline_stages_trace_with_no_host_tensor() -> None:
    """PP2: both stages' steps run (the last stage used to abort in the pipeline's backward), every tensor of the
    step on the device, parameters told apart from activations without module hooks."""
    out = trace_spec(tiny_spec(pipeline_model_parallel_size=2, global_batch_size=8), None)
    assert [r["traced_as"] for r in out["ranks"]] == [0, 1]
    assert out["host_tensors"] == 0
    for rank in out["ranks"]:
        assert {"params", "activations", "optimizer"} <= set(rank["breakdown"])


@pytest.mark.slow
def test_pipeline_stages_grow_with_the_micro_batch_count_as_planned() -> None:
    """From 3 to 6 micro-batches (both past 1F1B's warm-up on every stage) each stage's traced peak grows as the
    planner's does: the receive buffers torch.distributed.pipelining keeps per micro-batch and the stacked ids,
    labels and positions (``pipeline_buffer_bytes``), within one micro-batch's hidden states. The schedule's
    ``step`` used to keep every micro-batch's output on the last stage until the step ended, to concatenate them
    for a return value nobody read: one more hidden state per micro-batch there (640 MiB for Qwen3-32B TP4 PP2 SP
    at GBS 64)."""
    few, many = (trace_spec(tiny_spec(pipeline_model_parallel_size=2, global_batch_size=g), None) for g in (6, 12))
    hidden = 2 * 128 * TINY["hidden_size"] * 2  # one micro-batch's hidden states: MBS 2 x 128 tokens, bf16
    for a, b in zip(few["ranks"], many["ranks"], strict=True):
        traced, planned = b["peak_bytes"] - a["peak_bytes"], b["planner_bytes"] - a["planner_bytes"]
        assert planned > 0 and abs(traced - planned) < hidden, (a["rank"], traced, planned)


@pytest.mark.slow
def test_lora_traces_with_its_frozen_base() -> None:
    """LoRA over DP2: the frozen base takes no gradient hook (MemTracker used to refuse it), the adapters' Adam state
    is all the optimizer holds, and building the adapters on the host is construction, not the step."""
    out = trace_spec(tiny_spec(lora_r=4, lora_alpha=8), None)
    rank = out["ranks"][0]
    assert rank["peak_bytes"] > 0 and rank["breakdown"]["optimizer"] < rank["breakdown"]["params"] / 4
    assert "aten.uniform_.default" not in rank["host_ops"]


@pytest.mark.slow
def test_tp2_traces_on_npu_with_the_fused_norm_on_local_tensors() -> None:
    """TP2 on NPU: the norm weights are DTensors, which torch_npu's npu_rms_norm has no sharding strategy for (every
    TP layout used to fail); lean_ops runs it on the local tensors. DTensor's own sharding propagation is not
    counted as the step's host tensors."""
    out = trace_spec(tiny_spec(tensor_model_parallel_size=2), None)
    assert out["host_tensors"] == 0
    rank = out["ranks"][0]
    assert {"params", "activations", "optimizer"} <= set(rank["breakdown"])
    assert rank["collective_bytes_per_step"]["all_reduce"] > 0


@pytest.mark.slow
def test_tp_under_pp_traces_both_stages_in_one_process() -> None:
    """TP2 PP2: the second stage's trace used to be handed the first trace's TP mesh (DTensor's sharding cache keys
    meshes by layout, and that mesh's process groups had died with its trace)."""
    out = trace_spec(
        tiny_spec(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            global_batch_size=8,
            resources={"device_type": "npu", "nproc_per_node": 4},
        ),
        None,
    )
    assert [r["traced_as"] for r in out["ranks"]] == [0, 0, 2, 2]
    assert out["host_tensors"] == 0


@pytest.mark.slow
def test_sequence_parallel_tp_under_pp_traces_both_stages() -> None:
    """TP2 PP2 with SP: the second stage's backward reduce-scatters used to run on the first trace's TP group ("Could
    not resolve the process group registered under the name 7"): the npu backward runs on the autograd engine's
    device thread, whose C++ sharding cache (per thread) still held the first trace's meshes."""
    spec = tiny_spec(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        sequence_parallel=True,
        global_batch_size=8,
        resources={"device_type": "npu", "nproc_per_node": 4},
    )
    out = trace_spec(spec, None)
    assert [r["traced_as"] for r in out["ranks"]] == [0, 0, 2, 2]
    assert out["host_tensors"] == 0
    assert all(out["ranks"][i]["collective_bytes_per_step"]["reduce_scatter"] > 0 for i in (0, 2))


@pytest.mark.slow
def test_ulysses_cp_under_tp_and_pp_traces_on_the_shards_the_job_cuts() -> None:
    """CP2 (Ulysses) TP2 PP2: the trace cuts each rank's CP share as the job does (``context_shard`` at the
    pipeline's one width), so the fused attention gets T = CP × local tokens with cumulative lengths ending at T
    (the whole rows used to reach it: actual_seq_qlen[-1] = 254 for T = 508). The per-forward read of the tokens MoE
    routing counts (CP padded 254 to 256) is answered from the host shard and reported as a sync."""
    spec = tiny_spec(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        context_parallel_size=2,
        context_parallel_algo="ulysses_cp_algo",
        global_batch_size=8,
        resources={"device_type": "npu", "nproc_per_node": 8},
    )
    out = trace_spec(spec, None)
    assert [r["traced_as"] for r in out["ranks"]] == [0, 0, 2, 2, 0, 0, 2, 2]
    assert out["host_tensors"] == 0
    stage0 = out["ranks"][0]
    assert stage0["collective_bytes_per_step"]["all_to_all"] > 0
    assert stage0["host_syncs"]["aten._local_scalar_dense.default"] > 0


@pytest.mark.slow
def test_lora_under_pp_traces_with_no_host_tensor() -> None:
    """LoRA TP1 PP2 on 2 ranks (the seed's LoRA line): the frozen base is left out of FSDP (one DP rank), so its
    parameters are plain fake tensors, which ``to_empty`` swaps (the fake mode's weak references used to refuse the
    swap); the loss's placeholder for the frozen head's gradient is made on the device (was a host tensor)."""
    out = trace_spec(tiny_spec(lora_r=4, lora_alpha=8, pipeline_model_parallel_size=2, global_batch_size=8), None)
    assert [r["traced_as"] for r in out["ranks"]] == [0, 1]
    assert out["host_tensors"] == 0
    for rank in out["ranks"]:
        assert rank["breakdown"]["optimizer"] < rank["breakdown"]["params"] / 4


@pytest.mark.slow
def test_dpo_traces_with_its_reference_model() -> None:
    """Stage dpo over DP2: micro-batches of pairs (chosen and rejected rows), the frozen reference copy built as the
    trainer builds it (its weights left unfilled, as the policy's are), the plain causal rows planned on the host.
    DPO's per-sequence token counts (``bincount``) are device -> host syncs, reported."""
    out = trace_spec(tiny_spec(stage="dpo", is_pairwise_dataset=True), None)
    assert out["host_tensors"] == 0
    rank = out["ranks"][0]
    assert rank["host_syncs"]["aten.bincount.default"] > 0
    # the reference's bf16 copy beside the policy: more than the policy's own fp32 shard of the weights
    sft = trace_spec(tiny_spec(), None)["ranks"][0]
    assert rank["breakdown"]["params"] > sft["breakdown"]["params"] * 1.2


@pytest.mark.slow
def test_moe_under_expert_parallelism_traces_with_balanced_routing() -> None:
    """EP4 over 4 DP ranks: the EP mesh split out of DP (``DeviceMesh._unflatten``) on host tables, the all-to-all
    splits and the padded expert kernel's busiest expert (host reads of the routing) answered as balanced routing."""
    spec = tiny_spec(
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        expert_model_parallel_size=4,
        global_batch_size=8,
        resources={"device_type": "npu", "nproc_per_node": 4},
    )
    out = trace_spec(spec, None)
    assert out["host_tensors"] == 0
    rank = out["ranks"][0]
    assert rank["collective_bytes_per_step"]["all_to_all"] > 0
    assert rank["host_syncs"]["aten._local_scalar_dense.default"] > 0


MOE = {
    "num_experts": 8,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 64,
    "expert_model_parallel_size": 2,
    "global_batch_size": 4,
}


def test_admission_traces_only_what_the_planner_has_no_model_of_and_within_its_budget() -> None:
    """MoE on npu (the padded expert kernel) is traced; a dense job is not; a trace over the budget leaves the
    decision to the planner (None)."""
    from engine.contract.trace_admission import admit_by_trace, trace_features

    moe = tiny_spec(**MOE)
    assert trace_features(moe) == ["moe_expert_kernel"] and trace_features(tiny_spec()) == []
    assert admit_by_trace(tiny_spec(), 2**20, 600) is None
    assert admit_by_trace(moe, 2**30, 0.5) is None


@pytest.mark.slow
def test_admission_by_trace_decides_on_the_traced_peak() -> None:
    """Within the budget the child process's traced peak decides, and a refusal says it was traced and why."""
    from engine.contract.trace_admission import admit_by_trace

    verdict = admit_by_trace(tiny_spec(**MOE), 2**20, 600)
    assert verdict is not None and verdict.peak_bytes > 2**20 and not verdict.fits
    assert "traced, not planned: the planner has no model of moe_expert_kernel" in verdict.message()


@pytest.mark.slow
def test_serve_traces_the_model_and_the_whole_kv_cache_at_its_largest_step() -> None:
    """A serve job under TP2: the serving model built by ``build_model`` (no checkpoint read), the slot cache of
    max_num_seqs × max_model_len, and the serving forward at its largest step, on the device with no host tensor."""
    spec = parse_spec(
        {
            "kind": "serve",
            "load": "unused",
            "bf16": True,
            "max_num_seqs": 4,
            "max_model_len": 256,
            "tensor_model_parallel_size": 2,
            "resources": {"device_type": "npu", "nproc_per_node": 2},
            **TINY,
        }
    )
    assert isinstance(spec, ServeSpec)
    out = trace_spec(spec, None)
    assert out["host_tensors"] == 0 and [r["traced_as"] for r in out["ranks"]] == [0, 0]
    rank = out["ranks"][0]
    # the cache alone: layers × (k, v) × slots × KV heads per rank × positions × head dim × bf16
    cache = 2 * 2 * 4 * 1 * 256 * 32 * 2
    assert rank["breakdown"]["activations"] > cache
    assert rank["collective_bytes_per_step"]["all_reduce"] > 0


PRECISION_AWARE = {
    "use_precision_aware_optimizer": True,
    "main_grads_dtype": "bf16",
    "exp_avg_dtype": "bf16",
    "exp_avg_sq_dtype": "bf16",
}
OFFLOAD = {"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0}


@pytest.mark.slow
@pytest.mark.parametrize("option", [PRECISION_AWARE, OFFLOAD, {**PRECISION_AWARE, **OFFLOAD}])
def test_optimizer_options_trace_as_the_planner_counts_them(option: dict[str, Any]) -> None:
    """Issue 42: the trace steps the job's optimizer (``build_optimizer``: the precision-aware AdamW, its master,
    bf16 weights and grads, the offloaded share on the host). Over FSDP2 (DP2) the optimizer state left on the
    device and the host's peak (offloaded master and moments, the step's fp32 slices) match the planner's within
    5 %; with offload nothing of the state stays on the device (``DTensor.from_local`` used to move it back)."""
    from engine.contract.plan.planner import plan_spec

    spec = tiny_spec(seq_length=32, micro_batch_size=1, global_batch_size=4, **option)
    row = trace_spec(spec, None)["ranks"][0]
    planned = plan_spec(spec, None).ranks[0]
    master = planned.main_params - planned.grads  # bf16 weights: main_params = weights + the optimizer's master
    on_device = planned.optimizer + (master if option.get("main_grads_dtype") == "bf16" else 0)
    if option.get("optimizer_cpu_offload"):
        assert "optimizer" not in row["breakdown"] and on_device == planned.optimizer == 0
        assert abs(row["host_planner_vs_trace"]) <= 0.05
        assert row["host_peak_bytes"] > planned.trainable_params // 2 * 8  # DP2: master and bf16 moments at least
    else:
        assert row["breakdown"]["optimizer"] == pytest.approx(on_device, rel=0.05)
        assert row["host_planner_vs_trace"] is None and row["host_peak_bytes"] < 2**10  # the step counters only
