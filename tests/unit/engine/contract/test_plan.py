"""The memory planner (engine.contract.plan): Megatron's figures for the seed's Qwen3-4B line, schedules, LoRA, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.contract.layout import ParallelDims
from engine.contract.model_config import preset
from engine.contract.plan import DoesNotFit, Layout, check_fits, plan_ranks, plan_spec
from engine.contract.plan.cli import split_torchrun
from engine.contract.plan.memory import MIB, in_flight
from engine.contract.spec import parse_spec
from train_support import QWEN3_4B, write_instruction_data

ROOT = Path(__file__).resolve().parents[4]


def seed_full(**extra: Any) -> dict[str, Any]:
    """The seed's full-SFT line: TP1 PP2 on 2 devices, MBS 8, GBS 128, seq 800, bf16, distributed optimizer."""
    return {
        "kind": "train",
        "data_path": ["d"],
        "train_iters": 1,
        "lr": 1e-6,
        "bf16": True,
        "seq_length": 800,
        "micro_batch_size": 8,
        "global_batch_size": 128,
        "pipeline_model_parallel_size": 2,
        "use_distributed_optimizer": True,
        "resources": {"device_type": "npu", "nproc_per_node": 2},
        **QWEN3_4B,
        **extra,
    }


def test_seed_weight_and_optimizer_matches_megatron() -> None:
    """Megatron printed 'weight and optimizer = 37865.08 MB' (18 B × 2.2058e9 params of the most loaded shard)."""
    ranks = plan_spec(parse_spec(seed_full())).ranks
    assert ranks[0].num_params == pytest.approx(2.2058e9, rel=1e-4)
    assert ranks[0].persistent_bytes / MIB == pytest.approx(37865.08, rel=1e-3)
    assert ranks[1].num_params == pytest.approx(ranks[0].num_params, rel=1e-3)  # last stage: tied head copy + norm
    assert ranks[0].micro_batches_in_flight == 2 and ranks[1].micro_batches_in_flight == 1
    assert ranks[1].loss > 0 and ranks[0].loss == 0


def test_distributed_optimizer_shards_fp32_state_over_dp() -> None:
    one = plan_spec(parse_spec(seed_full(resources={"device_type": "npu", "nproc_per_node": 2}))).ranks[0]
    four = plan_spec(
        parse_spec(seed_full(global_batch_size=128, resources={"device_type": "npu", "nproc_per_node": 8}))
    ).ranks[0]
    assert four.params == one.params  # bf16 compute weights stay whole (gathered for the PP step)
    for part in ("main_params", "grads", "optimizer"):
        assert getattr(four, part) * 4 == pytest.approx(getattr(one, part), rel=1e-6)


def test_lora_keeps_base_once_in_bf16_and_trains_only_adapters() -> None:
    full = plan_spec(parse_spec(seed_full())).ranks[0]
    lora = plan_spec(parse_spec(seed_full(lora_r=16, lora_alpha=32))).ranks[0]
    assert lora.params == full.params  # the frozen base: 2 B per parameter
    adapters = lora.trainable_params
    # r × (in + out) for qkv, proj, fc1, fc2 over 18 layers
    per_layer = 16 * ((2560 + 6144) + (4096 + 2560) + (2560 + 2 * 9728) + (9728 + 2560))
    assert adapters == 18 * per_layer
    assert lora.grads == adapters * 4 and lora.optimizer == adapters * 8 and lora.main_params == adapters * 4


def test_recompute_and_micro_batch_scale_activations() -> None:
    base = plan_spec(parse_spec(seed_full())).ranks[0].activations
    half = plan_spec(parse_spec(seed_full(micro_batch_size=4, global_batch_size=64))).ranks[0].activations
    full = plan_spec(parse_spec(seed_full(recompute_granularity="full"))).ranks[0].activations
    selective = plan_spec(parse_spec(seed_full(recompute_granularity="selective"))).ranks[0].activations
    assert half == pytest.approx(base / 2, rel=0.01)
    assert full < selective < base


def test_interleaved_schedule_holds_megatron_warmup_chunks() -> None:
    lay = Layout(dims=ParallelDims(pp=4), micro_batch_size=1, global_batch_size=8, layers_per_virtual_stage=1)
    assert [in_flight(lay, p, chunks=2) for p in range(4)] == [11, 9, 7, 5]
    ranks = plan_ranks(
        preset("qwen3-tiny"), Layout(dims=ParallelDims(pp=2), global_batch_size=4, layers_per_virtual_stage=1)
    )
    assert [r.layers for r in ranks] == [[0], [1]]


def test_pipeline_stages_keep_a_receive_buffer_per_micro_batch_of_the_step() -> None:
    """torch.distributed.pipelining allocates each stage's receive buffers (the previous stage's hidden states, the
    next stage's gradient of them) once per micro-batch index and keeps them, and the step stacks every
    micro-batch's int64 ids, labels and positions on the device: stage memory grows with the step's micro-batches,
    not only with those in flight. Measured by ``python -m engine trace`` on Qwen3-32B's widths with 4 layers, TP4
    PP2 SP: stage 0's peak grew by 10,336 KiB per micro-batch from GBS 3 to 6 (the 10 MiB hidden-state shard, 4096
    / 4 tokens x 5120 x bf16, and 96 KiB of ids, labels and positions); the planner's figure did not move."""
    cfg = preset("qwen3-32b")

    def totals(pp: int, gbs: int) -> list[int]:
        lay = Layout(
            dims=ParallelDims(tp=4, pp=pp),
            seq_length=4096,
            global_batch_size=gbs,
            compute_bytes=2,
            distributed_optimizer=True,
            sequence_parallel=True,
            device_type="npu",
        )
        return [r.total_bytes for r in plan_ranks(cfg, lay)[::4]]  # TP rank 0 of each stage

    per_micro_batch = 4096 // 4 * 5120 * 2 + 4096 * 3 * 8
    assert per_micro_batch == 10_336 * 1024
    few, many = totals(2, 3), totals(2, 6)
    assert [b - a for a, b in zip(few, many, strict=True)] == [3 * per_micro_batch] * 2
    # a middle stage receives from both neighbours: two buffers per micro-batch
    few, many = totals(4, 4), totals(4, 8)
    boundary = 4096 // 4 * 5120 * 2
    assert [b - a for a, b in zip(few, many, strict=True)] == [4 * (n * boundary + 4096 * 24) for n in (1, 2, 2, 1)]


def test_seed_full_line_fits_64_gib_at_full_length() -> None:
    """Issue 23: every micro-batch at 800 tokens, rank 0 (two micro-batches in flight) stays under 60 GiB."""
    fitting = check_fits(parse_spec(seed_full()), 64 * 2**30)
    assert fitting.peak.rank == 0 and fitting.peak.total_bytes <= 60 * 2**30


def test_does_not_fit_names_the_field_and_gives_the_breakdown() -> None:
    spec = parse_spec(seed_full(micro_batch_size=16))
    with pytest.raises(DoesNotFit) as err:
        check_fits(spec, 64 * 2**30)
    assert err.value.field == "micro_batch_size" and "activations" in str(err.value) and "optimizer" in str(err.value)
    with pytest.raises(DoesNotFit) as err:
        check_fits(spec, 16 * 2**30)
    assert err.value.field == "pipeline_model_parallel_size"
    fitting = check_fits(parse_spec(seed_full(micro_batch_size=1, global_batch_size=16)), 64 * 2**30)
    assert fitting.peak.total_bytes <= 64 * 2**30


def test_split_torchrun_takes_world_size_from_launcher() -> None:
    flags, res, script = split_torchrun(
        [
            "torchrun",
            "--nproc_per_node",
            "4",
            "--nnodes=2",
            "--master_port",
            "6000",
            "posttrain_gpt.py",
            "--bf16",
            "--seq-length",
            "8",
        ]
    )
    assert res == {"nproc_per_node": 4, "nnodes": 2} and script == "posttrain_gpt.py"
    assert flags == ["--bf16", "--seq-length", "8"]


def test_shape_from_hf_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(preset("qwen3-0.6b").to_hf()))
    spec = parse_spec(
        {"kind": "train", "data_path": ["d"], "train_iters": 1, "lr": 0.1, "seq_length": 64, "load": str(tmp_path)}
    )
    plan = plan_spec(spec)
    assert plan.cfg == preset("qwen3-0.6b").replace(max_position_embeddings=plan.cfg.max_position_embeddings)
    assert plan.source.startswith("checkpoint")


def test_cli_prints_table_and_json_last_line_without_torch() -> None:
    code = (
        "import sys, runpy; sys.argv = ['engine', 'plan'] + sys.argv[1:]; "
        "from engine.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'planner imported torch'; raise SystemExit(rc)"
    )
    line = [
        "torchrun",
        "--nproc_per_node",
        "2",
        "posttrain_gpt.py",
        "--num-layers",
        "36",
        "--hidden-size",
        "2560",
        "--ffn-hidden-size",
        "9728",
        "--num-attention-heads",
        "32",
        "--group-query-attention",
        "--num-query-groups",
        "8",
        "--kv-channels",
        "128",
        "--padded-vocab-size",
        "151936",
        "--bf16",
        "--seq-length",
        "800",
        "--micro-batch-size",
        "8",
        "--global-batch-size",
        "128",
        "--pipeline-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--data-path",
        "x",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", code, *line],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["rank"] for r in last["ranks"]] == [0, 1]
    assert last["ranks"][0]["total_bytes"] > last["ranks"][0]["persistent_bytes"] > 0
    assert "rank" in proc.stdout.splitlines()[1]


def test_shape_from_megatron_args_without_torch(tmp_path: Path) -> None:
    """The mcore rank file's ``args`` are read by the allow-list unpickler; a planted class is never called."""
    import torch

    from engine.checkpoint.megatron_write import save_mcore
    from engine.contract.plan.shape import config_from_checkpoint
    from engine.model.qwen3 import Qwen3Model

    cfg = preset("qwen3-tiny")
    save_mcore(Qwen3Model(cfg).state_dict(), cfg, tmp_path / "mg", tp=1, pp=2, dtype=torch.bfloat16)
    got = config_from_checkpoint(tmp_path / "mg")
    assert (
        got is not None
        and got.replace(
            norm_epsilon=cfg.norm_epsilon,
            rotary_base=cfg.rotary_base,
            max_position_embeddings=cfg.max_position_embeddings,
            init_method_std=cfg.init_method_std,
        )
        == cfg
    )
    spec = parse_spec(
        {
            "kind": "train",
            "data_path": ["d"],
            "train_iters": 1,
            "lr": 0.1,
            "seq_length": 64,
            "load": str(tmp_path / "mg"),
            "pipeline_model_parallel_size": 2,
            "resources": {"nproc_per_node": 2},
        }
    )
    assert plan_spec(spec).source.startswith("checkpoint")


def test_unpickler_refuses_to_call_anything(tmp_path: Path) -> None:
    import pickle
    import zipfile

    from engine.contract.plan.shape import config_from_checkpoint

    class Boom:
        def __reduce__(self) -> Any:
            return (Path.write_text, (tmp_path / "pwned", "x"))

    rank = tmp_path / "mg" / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    (tmp_path / "mg" / "latest_checkpointed_iteration.txt").write_text("1")
    with zipfile.ZipFile(rank / "model_optim_rng.pt", "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"args": Boom()}))
    assert config_from_checkpoint(tmp_path / "mg") is None
    assert not (tmp_path / "pwned").exists()


def test_eval_holds_weights_and_kv_cache_only() -> None:
    spec = parse_spec(
        {
            "kind": "eval",
            "load": "none",
            "eval_data_path": "x",
            "bf16": True,
            "seq_length": 1024,
            "max_new_tokens": 128,
            "micro_batch_size": 4,
            "pipeline_model_parallel_size": 2,
            "resources": {"nproc_per_node": 2},
            **QWEN3_4B,
        }
    )
    ranks = plan_spec(spec).ranks
    assert ranks[0].grads == ranks[0].optimizer == ranks[0].main_params == ranks[0].optimizer_step == 0
    assert ranks[0].params == ranks[0].num_params * 2
    kv = 2 * 18 * 4 * (1024 + 128) * 8 * 128 * 2  # K and V, 18 layers, batch 4, 8 groups × 128, bf16
    assert ranks[0].activations > kv


def test_optimizer_step_has_no_full_size_temporary() -> None:
    """Fused AdamW (CPU, CUDA) allocates nothing; the foreach fallback one bounded group or the largest tensor."""
    for device in ("cpu", "cuda"):
        res = {"device_type": device, "nproc_per_node": 2}
        assert all(r.optimizer_step == 0 for r in plan_spec(parse_spec(seed_full(resources=res))).ranks)
    npu = plan_spec(parse_spec(seed_full())).ranks[0]
    assert npu.optimizer_step == 151936 * 2560 * 4  # the embedding, the largest tensor, in fp32
    assert npu.optimizer_step < npu.trainable_params * 4 / 5


def test_dpo_counts_the_pairs_and_the_reference_copy() -> None:
    """Stage dpo: a micro-batch holds both answers of each pair (twice the rows), and a full (not LoRA) run with a
    reference loss holds a frozen compute-dtype copy of the model, sharded like the policy."""
    base = seed_full(pipeline_model_parallel_size=1, micro_batch_size=2, global_batch_size=16)
    dpo = {**base, "stage": "dpo", "is_pairwise_dataset": True}
    sft = plan_spec(parse_spec(base)).peak
    full = plan_spec(parse_spec(dpo)).peak
    simpo = plan_spec(parse_spec({**dpo, "dpo_loss_type": "simpo"})).peak
    lora = plan_spec(parse_spec({**dpo, "lora_r": 8})).peak
    assert full.activations == pytest.approx(2 * sft.activations, rel=0.01) and simpo.activations == full.activations
    assert sft.reference == simpo.reference == lora.reference == 0
    assert full.reference > full.num_params * 2 // 2  # its bf16 shard over DP 2, plus gathered layers and a forward
    room = (simpo.total_bytes + full.total_bytes) // 2
    check_fits(parse_spec({**dpo, "dpo_loss_type": "simpo"}), room)
    with pytest.raises(DoesNotFit) as err:
        check_fits(parse_spec(dpo), room)
    assert "reference model" in str(err.value)


def test_a_4b_dpo_refused_with_its_reference_copy_fits_with_precomputed_log_probs() -> None:
    """Issue 26: the seed's Qwen3-4B on two 64 GiB NPUs (DP 2, micro-batches of 6 pairs at seq 800) overflows with the
    frozen reference copy, and the refusal's breakdown names it; with precompute_ref_log_probs the copy exists only in
    the pass before training (no gradients or optimizer state yet), so the same run is admitted."""
    base = seed_full(pipeline_model_parallel_size=1, micro_batch_size=6, global_batch_size=48)
    dpo = {**base, "stage": "dpo", "is_pairwise_dataset": True}
    with pytest.raises(DoesNotFit) as err:
        check_fits(parse_spec(dpo), 64 * 2**30)
    assert "reference model 5.08 GiB" in str(err.value) and "a device has 64.00 GiB" in str(err.value), err.value
    assert "it would fit with precompute_ref_log_probs true (63.6" in str(err.value), err.value
    fitting = check_fits(parse_spec({**dpo, "precompute_ref_log_probs": True}), 64 * 2**30)
    assert fitting.peak.reference == 0 and fitting.peak.total_bytes <= 64 * 2**30


def test_admission_decides_on_this_data(tmp_path: Path) -> None:
    """Issue 23 item 5: short samples make micro-batches far below seq_length; the plan reads their lengths from the
    index, reports both figures, decides on the data's, and names what would make a still-too-big job fit."""
    prefix = write_instruction_data(tmp_path / "short", n=64)
    extra = {"micro_batch_size": 16, "train_iters": 3, "variable_seq_lengths": True, "padding_free": False}
    worst_only = parse_spec(seed_full(**extra))
    with pytest.raises(DoesNotFit):  # at 16 × 800 tokens the worst case does not fit (as above)
        check_fits(worst_only, 64 * 2**30)
    plan = check_fits(parse_spec(seed_full(data_path=[prefix], **extra)), 64 * 2**30)
    assert plan.data is not None and plan.data.rows == 16 and plan.data.width <= 38
    assert plan.data_peak is not None and plan.decisive is plan.data_peak
    assert plan.data_peak.total_bytes < plan.peak.total_bytes == plan_spec(worst_only).peak.total_bytes
    shown = plan.as_json()
    assert shown["this_data_bytes"] == plan.data_peak.total_bytes and shown["worst_case_bytes"] == plan.peak.total_bytes
    assert (
        shown["max_total_bytes"] == shown["this_data_bytes"] and shown["this_data_batch"]["tokens"] == plan.data.tokens
    )
    with pytest.raises(DoesNotFit) as err:  # persistent state fits 45 GiB, these activations do not
        check_fits(parse_spec(seed_full(data_path=[prefix], **{**extra, "micro_batch_size": 128})), 45 * 2**30)
    message = str(err.value)
    assert "on this data (its largest micro-batch: 128 × " in message and "at the worst case" in message
    assert "it would fit with recompute_granularity" in message, message


def test_context_parallel_splits_activations_and_lets_32k_fit() -> None:
    """Issue 29: Qwen3-4B full SFT at 32K tokens on eight 64 GiB NPUs: every rank's activations for a whole sequence
    (113 GiB) do not fit; split over CP 8 each rank holds 1/8 of them and FSDP shards the state over DP × CP."""
    long = dict(seq_length=32768, micro_batch_size=1, global_batch_size=8, pipeline_model_parallel_size=1)
    nodes = {"resources": {"device_type": "npu", "nproc_per_node": 8}}
    whole = plan_spec(parse_spec(seed_full(**long, **nodes))).peak
    split = plan_spec(parse_spec(seed_full(**long, **nodes, context_parallel_size=8))).peak
    assert split.activations == pytest.approx(whole.activations / 8, rel=0.02)
    assert split.optimizer == whole.optimizer  # eight shards either way: DP 8, or DP 1 × CP 8
    with pytest.raises(DoesNotFit):
        check_fits(parse_spec(seed_full(**long, **nodes)), 64 * 2**30)
    check_fits(parse_spec(seed_full(**long, **nodes, context_parallel_size=8)), 64 * 2**30)


def test_the_ring_counts_its_blocks_and_no_mask() -> None:
    """Issue 29: ring CP saves attention's q, k, v, output and lse like a flash kernel (never a T × T mask, on CPU
    too), and adds its backward working set: blocks in flight, their fp32 gradients, expanded K/V, score tiles."""
    long = dict(seq_length=32768, micro_batch_size=1, global_batch_size=8, pipeline_model_parallel_size=1)
    nodes = {"resources": {"device_type": "npu", "nproc_per_node": 8}}
    ulysses = plan_spec(parse_spec(seed_full(**long, **nodes, context_parallel_size=8))).peak
    ring = plan_spec(
        parse_spec(seed_full(**long, **nodes, context_parallel_size=8, context_parallel_algo="megatron_cp_algo"))
    ).peak
    tokens, d = 32768 // 8, 128  # per rank; Qwen3-4B: 32 heads, 8 KV groups of 128, bf16
    working = tokens * d * (2 * 2 * 2 * 8 + 2 * 2 * 4 * 8 + 2 * 4 * 32 + 3 * 4 * 32) + 4 * (32 << 20)
    assert ring.activations - ulysses.activations == working
    cpu = {"resources": {"device_type": "cpu", "nproc_per_node": 8}}
    cpu_ring = plan_spec(
        parse_spec(seed_full(**long, **cpu, context_parallel_size=8, context_parallel_algo="megatron_cp_algo"))
    ).peak
    cpu_ulysses = plan_spec(parse_spec(seed_full(**long, **cpu, context_parallel_size=8))).peak
    assert cpu_ulysses.activations - cpu_ring.activations > 32768**2 - working  # Ulysses' CPU mask is T × T


def test_plan_suggest_lists_fitting_layouts_best_first() -> None:
    """``python -m engine plan --suggest``: Qwen3-4B full SFT at 32K on 8 × 64 GiB does not fit as given (no CP, no
    recompute); the suggestions all fit, cheapest recompute first, then the fewest ranks per sequence."""
    line = [
        "--nproc_per_node", "8", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
        "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
        "--padded-vocab-size", "151936", "--bf16", "--seq-length", "32768", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--use-distributed-optimizer", "--data-path", "x",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "plan", "--suggest", "--device-memory-gib", "64", "--device-type", "npu", *line],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["max_total_bytes"] > 64 * 2**30  # as given, it does not fit
    found = last["suggestions"]
    assert found and all(s["fits"] and s["peak_bytes"] <= 64 * 2**30 for s in found)
    order = ["none", "selective", "full"]
    keys = [(order.index(s["recompute"]), s["cp"] * s["tp"], s["peak_bytes"]) for s in found]
    assert keys == sorted(keys)
    assert found[0]["cp"] > 1 and "layouts that fit 64.00 GiB per device" in proc.stdout
