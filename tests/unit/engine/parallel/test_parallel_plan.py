"""Single-process checks of the TP/PP planning code: stage split, layout validation, micro-batch stacking,
checkpoint key views, and the vocab-parallel loss on a one-rank TP mesh (equal to the plain chunked loss)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from engine.contract import layout
from engine.contract.model_config import preset
from engine.contract.runfiles import BadInput
from engine.model.loss import chunked_cross_entropy
from engine.model.qwen3 import Qwen3Model
from engine.parallel.mesh import ParallelDims
from engine.parallel.pipeline_parallel import (
    build_stage_module,
    check_parallel_layout,
    dcp_state_view,
    pipeline_width,
    stack_micro_batches,
    stage_layers,
)
from engine.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy
from engine.train.batches import Sample, pack, pad


def test_stage_layers_even_list_and_virtual() -> None:
    assert stage_layers(4, 2) == [[0, 1], [2, 3]]
    assert stage_layers(4, 2, num_layer_list=[1, 3]) == [[0], [1, 2, 3]]
    # Megatron's interleaving: chunk v of rank p is stage v·PP + p, holding Lv consecutive layers.
    assert stage_layers(8, 2, layers_per_virtual_stage=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((5, 2), "pipeline_model_parallel_size"),
        ((4, 2, [1, 2]), "num_layer_list"),
        ((6, 2, None, 4), "num_layers_per_virtual_pipeline_stage"),
    ],
)
def test_stage_layers_refuses_uneven_layouts(args: tuple, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        stage_layers(*args)


def test_tensor_parallel_needs_whole_kv_groups() -> None:
    cfg = preset("qwen3-tiny")  # 4 heads, 2 KV groups
    layout.check(cfg, layout.ParallelDims(tp=2))
    with pytest.raises(layout.LayoutError, match=r"^tensor_model_parallel_size: TP 4 does not divide the model's 2 KV"):
        layout.check(cfg, layout.ParallelDims(tp=4))


def _spec(**kw: object) -> types.SimpleNamespace:
    base = {"num_layers_per_virtual_pipeline_stage": None, "num_layer_list": None, "micro_batch_size": 1}
    return types.SimpleNamespace(**{**base, **kw})


def test_layout_check_names_the_flag() -> None:
    cfg = preset("qwen3-tiny").replace(num_layers=4)
    with pytest.raises(BadInput) as err:
        check_parallel_layout(_spec(), cfg, ParallelDims(dp=1, pp=1, tp=4), 4)
    assert err.value.field == "tensor_model_parallel_size"
    with pytest.raises(BadInput) as err:
        check_parallel_layout(_spec(num_layers_per_virtual_pipeline_stage=1), cfg, ParallelDims(pp=1), 4)
    assert err.value.field == "num_layers_per_virtual_pipeline_stage"
    with pytest.raises(BadInput) as err:  # interleaved 1F1B: micro-batches must be a multiple of PP
        check_parallel_layout(_spec(num_layers_per_virtual_pipeline_stage=1), cfg, ParallelDims(pp=2), 3)
    assert err.value.field == "global_batch_size"
    with pytest.raises(BadInput, match="^global_batch_size: 1F1B needs at least PP"):
        check_parallel_layout(_spec(), cfg, ParallelDims(pp=2), 1)
    check_parallel_layout(_spec(num_layer_list=[1, 3]), cfg, ParallelDims(pp=2), 4)


def test_stack_micro_batches_pads_to_one_width() -> None:
    a = pack([Sample([1, 2, 3, 4], [-100, 2, 3, 4]), Sample([5, 6, 7], [5, 6, 7])], seq_length=8)  # packed, 5 tokens
    b = pad([Sample([1, 2, 3], [1, 2, 3])], seq_length=8, to_longest=True)  # 2 tokens, no segments
    ids, labels, pos, seg, counted = stack_micro_batches([a, b], width=8)
    assert ids.shape == labels.shape == pos.shape == seg.shape == (2, 8)
    assert labels[0, 5:].eq(-100).all() and labels[1, 2:].eq(-100).all()
    assert pos[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4] and pos[1].tolist() == list(range(8))
    assert seg[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]  # padding continues the last sample (after it, causal)
    assert counted is None  # no micro-batch padded by context parallelism
    a.counted = torch.tensor([True, True, True, True, False])  # CP's own pad at the end of a's row
    counted = stack_micro_batches([a, b], width=8)[4]
    assert counted is not None and counted.tolist() == [[True] * 4 + [False] * 4, [True] * 2 + [False] * 6]
    assert pipeline_width(seq_length=8, micro_batch_size=2, padding_free=True) == 14
    with pytest.raises(ValueError, match="^seq_length:"):
        stack_micro_batches([a], width=4)


def test_tied_last_stage_gets_a_copy_and_checkpoints_skip_it() -> None:
    model = Qwen3Model(preset("qwen3-tiny-tied").replace(vocab_size=64))
    model.init_weights(0)
    last = build_stage_module(model, [1], first=False, last=True)
    assert last.embedding is None and list(last.decoder.layers) == ["1"]
    assert last.output_layer is not None and last.cfg.tie_word_embeddings  # the structure marks the copy
    assert torch.equal(last.output_layer.weight, model.embedding.word_embeddings.weight)
    state = {
        "model": {"output_layer.weight": torch.ones(1), "decoder.layers.1.x": torch.zeros(1)},
        "optim": {
            "state": {"output_layer.weight": {"exp_avg": torch.ones(1)}},
            "param_groups": [{"lr": 0.1, "params": ["output_layer.weight", "decoder.layers.1.x"]}],
        },
    }
    saved, _ = dcp_state_view(state, last, "save")
    assert "output_layer.weight" not in saved["model"] and saved["optim"]["state"] == {}
    assert saved["optim"]["param_groups"][0]["params"] == ["decoder.layers.1.x"]
    view, finish = dcp_state_view(state, last, "load")
    assert view["model"]["embedding.word_embeddings.weight"] is state["model"]["output_layer.weight"]
    view["optim"]["param_groups"] = [{"lr": 0.2, "params": ["whatever"]}]  # what DCP puts back for plain values
    done = finish()
    assert done["optim"]["param_groups"][0] == {"lr": 0.2, "params": ["output_layer.weight", "decoder.layers.1.x"]}


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_vocab_parallel_loss_equals_chunked_loss(one_rank_group: None) -> None:
    torch.manual_seed(0)
    model = Qwen3Model(preset("qwen3-tiny").replace(vocab_size=96))
    model.init_weights(0)
    ids = torch.randint(0, 96, (2, 12))
    labels = torch.randint(0, 96, (2, 12))
    labels[:, :3] = -100
    ref_sum, ref_n = chunked_cross_entropy(model(ids, return_hidden=True), model.output_weight(), labels, 5)
    ref_sum.backward()
    ref_grad = model.output_layer.weight.grad.clone()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    model.zero_grad()
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    loss_sum, n = vocab_parallel_cross_entropy(model(ids, return_hidden=True), model.output_weight(), labels, 5)
    loss_sum.backward()
    assert int(n) == int(ref_n) and loss_sum.item() == pytest.approx(ref_sum.item(), rel=1e-6)
    torch.testing.assert_close(model.output_layer.weight.grad.full_tensor(), ref_grad, rtol=1e-5, atol=1e-6)
    # The vocab-parallel embedding's gradient holds this rank's rows only (not a replicated V × H tensor).
    assert model.embedding.word_embeddings.weight.grad.placements == (Shard(0),)


@pytest.mark.parametrize(("tp", "pp"), [(2, 2), (2, 1)])
def test_lora_export_is_cut_per_tp_pp_rank_like_mindspeed(tmp_path, tp: int, pp: int) -> None:
    from engine.checkpoint.megatron_read import RankFiles
    from engine.model.lora import apply_lora, lora_state_dict
    from engine.train.export import _write_lora

    cfg = preset("qwen3-tiny").replace(vocab_size=64, num_layers=4)
    model = Qwen3Model(cfg)
    apply_lora(model, r=4, alpha=8.0, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    adapters = lora_state_dict(model)
    spec = types.SimpleNamespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_layer_list=None,
        seq_length=16,
        num_layers_per_virtual_pipeline_stage=None,
        lora_r=4,
        lora_alpha=8.0,
        lora_target_modules=[],
        load=None,
    )
    it_dir = _write_lora(adapters, cfg, tmp_path, 7, spec, torch.float32)
    names = sorted(p.name for p in it_dir.iterdir())
    assert names == sorted(f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") for t in range(tp) for p in range(pp))
    last = torch.load(it_dir / names[-1] / "model_optim_rng.pt", weights_only=False)
    local = "decoder.layers.0.mlp.linear_fc1.lora_B.default.weight"  # layer 2 (or 0) renumbered locally
    assert last["model"][local].shape == (2 * cfg.ffn_hidden_size // tp, 4)
    assert last["args"].tensor_model_parallel_size == tp and last["args"].lora_alpha == 8.0
    files = RankFiles(tmp_path)
    for key, value in adapters.items():  # the reader glues the per-rank pieces back to the trained adapters
        torch.testing.assert_close(files.full(key), value)


def test_parallel_flags_under_torchrun_see_the_launcher_world(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.contract.flags import spec_from_argv

    argv = [
        "--data-path",
        "d",
        "--train-iters",
        "1",
        "--lr",
        "1e-4",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--num-layer-list",
        "1,3",
    ]
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    spec, _, _ = spec_from_argv("train", argv)
    assert (spec.resources.nnodes, spec.resources.nproc_per_node, spec.data_parallel_size) == (2, 4, 2)
    assert spec.sequence_parallel and spec.num_layer_list == [1, 3]
