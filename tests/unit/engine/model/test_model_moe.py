"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM (logits, loss and gradients, aux loss) and Megatron-Core's MoE
functions (switch load-balancing loss, token dropping) on the same weights, fp32 on CPU."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import (
    apply_router_token_dropping,
    switch_load_balancing_loss_func,
)
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from engine.contract.model_config import ModelConfig, preset
from engine.model import moe_mapping
from engine.model.loss import chunked_cross_entropy
from engine.model.moe import (
    MoELayer,
    capacity_keep,
    expert_capacity,
    last_forward_hf_aux_loss,
    moe_layers,
    router_metrics,
    set_aux_loss_token_scale,
)
from engine.model.qwen3 import Qwen3Model
from tests.unit.moe_support import VOCAB, disk_getter, hf_pair


@pytest.mark.parametrize(
    "overrides",
    [
        {"norm_topk_prob": True},
        {"norm_topk_prob": False},
        {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 2, "num_hidden_layers": 4},
    ],
    ids=["norm_topk", "no_norm_topk", "sparse_step2"],
)
def test_logits_match_transformers(overrides: dict) -> None:
    hf, ours = hf_pair(**overrides)
    step = overrides.get("decoder_sparse_step", 1)
    expected_moe = [
        i for i in range(hf.config.num_hidden_layers) if i not in hf.config.mlp_only_layers and (i + 1) % step == 0
    ]
    assert list(moe_layers(ours)) == expected_moe and len(expected_moe) < hf.config.num_hidden_layers  # dense mixed in
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff <= 1e-5, diff
    used = router_metrics(ours).tokens_per_expert  # type: ignore[union-attr]
    assert (used > 0).sum() >= 6  # the wide router really spreads tokens: a routing bug cannot hide


def test_routing_error_is_detected() -> None:
    """The parity bound discriminates: renormalising the top-k weights when HF does not is far outside it."""
    hf, ours = hf_pair(norm_topk_prob=False)
    for layer in moe_layers(ours).values():
        layer.norm_topk_prob = True
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() > 1e-2


def test_hf_checkpoint_names_load_and_round_trip(tmp_path) -> None:
    hf, _ = hf_pair(seed=1)
    hf.save_pretrained(tmp_path)
    disk = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in disk and "model.layers.0.mlp.gate.weight" in disk
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    native = dict(moe_mapping.native_from_hf(disk.__getitem__, cfg))
    assert native["decoder.layers.0.mlp.experts.linear_fc1.weight"].shape == (8, 32, 32)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in native  # the dense layer keeps the dense rules
    back = dict(moe_mapping.hf_from_native(native.__getitem__, cfg))
    assert back.keys() == disk.keys()
    assert all(torch.equal(back[k], disk[k]) for k in disk)


def test_loss_and_grads_match_transformers() -> None:
    hf, ours = hf_pair(seed=2)
    ids = torch.randint(0, VOCAB, (2, 20))
    labels = ids.clone()
    labels[0, :5] = -100
    ref = hf(ids, labels=labels).loss  # LM loss only (output_router_logits is off)
    ref.backward()
    hidden = ours(ids, return_hidden=True)
    loss_sum, n = chunked_cross_entropy(hidden[:, :-1], ours.output_weight(), labels[:, 1:], chunk_size=8)
    (loss_sum / n).backward()
    assert abs((loss_sum / n).item() - ref.item()) <= 1e-5
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    expected = dict(moe_mapping.native_from_hf(disk_getter(hf_grads), ours.cfg))
    got = {k: p.grad for k, p in ours.named_parameters()}
    assert expected.keys() == got.keys()
    for key, g in expected.items():
        torch.testing.assert_close(got[key], g, atol=1e-5, rtol=1e-4, msg=key)


def test_aux_loss_equals_transformers_value() -> None:
    hf, ours = hf_pair(seed=3)
    ids = torch.randint(0, VOCAB, (3, 16))
    with torch.no_grad():
        ref = hf(ids, output_router_logits=True).aux_loss
        ours(ids)
    assert abs(last_forward_hf_aux_loss(ours).item() - ref.item()) <= 1e-6


def _router_logits(model: Qwen3Model) -> list[torch.Tensor]:
    captured: list[torch.Tensor] = []
    for layer in moe_layers(model).values():
        layer.router.register_forward_hook(lambda _m, _i, out: captured.append(out))
    return captured


def test_aux_loss_value_and_gradient_follow_megatron() -> None:
    """Training with moe_aux_loss_coeff = c gives the gradient of lm_loss + sum_layers Megatron switch loss × c,
    without the caller adding anything; the logged value is Megatron's (loss / coeff, mean over layers)."""
    coeff, k = 0.3, 2
    _, ref_model = hf_pair(seed=4)
    cfg = ref_model.cfg.replace(moe_aux_loss_coeff=coeff)
    ours = Qwen3Model(cfg)
    ours.load_state_dict(ref_model.state_dict())
    ours.train()
    ref_model.train()
    for layer in moe_layers(ref_model).values():
        layer.aux_loss_coeff = 0.0
    ids = torch.randint(0, VOCAB, (2, 12))
    labels = torch.randint(0, VOCAB, (2, 12))

    def lm_loss(model: Qwen3Model) -> torch.Tensor:
        loss_sum, n = chunked_cross_entropy(model(ids, return_hidden=True), model.output_weight(), labels)
        return loss_sum / n

    lm_loss(ours).backward()  # the aux gradient comes in through the MoE layers' outputs
    logits = _router_logits(ref_model)
    loss = lm_loss(ref_model)
    megatron = []
    for lg in logits:
        probs = torch.softmax(lg, dim=-1, dtype=torch.float32)
        top = torch.topk(probs, k, dim=-1).indices
        tokens = torch.zeros_like(probs).scatter(1, top, 1.0).sum(0)
        megatron.append(switch_load_balancing_loss_func(probs, tokens, probs.shape[0], k, probs.shape[1], coeff))
    (loss + sum(megatron)).backward()
    for (name, p), q in zip(ours.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    router = ours.decoder.layers["0"].mlp.router.weight.grad
    assert router is not None and router.abs().max() > 0
    summary = router_metrics(ours).summary()  # type: ignore[union-attr]
    assert summary["load_balancing_loss"] == pytest.approx(
        float(sum(megatron).detach()) / coeff / len(megatron), rel=1e-5
    )


def test_aux_loss_token_scale_weights_by_routed_tokens() -> None:
    """With the trainer's per-token scale s, a micro-batch's aux gradient is s × its routed tokens (Megatron's
    calculate_per_token_loss), so micro-batches of different sizes count in proportion to their tokens."""
    _, base = hf_pair(seed=5)
    cfg = base.cfg.replace(moe_aux_loss_coeff=0.5)
    a, b = Qwen3Model(cfg), Qwen3Model(cfg)
    a.load_state_dict(base.state_dict())
    b.load_state_dict(base.state_dict())
    a.train(), b.train()
    ids = torch.randint(0, VOCAB, (1, 10))
    set_aux_loss_token_scale(a, 0.25)
    (a(ids).sum() * 0).backward()  # only the aux loss contributes
    (b(ids).sum() * 0).backward()
    ga = a.decoder.layers["0"].mlp.router.weight.grad
    gb = b.decoder.layers["0"].mlp.router.weight.grad
    torch.testing.assert_close(ga, gb * 0.25 * 10)


def test_no_aux_gradient_in_eval_or_when_coefficient_is_zero() -> None:
    _, ours = hf_pair(seed=6)
    ours.train()
    ids = torch.randint(0, VOCAB, (1, 8))
    for layer in moe_layers(ours).values():
        layer.aux_loss_coeff = 0.0
    (ours(ids).sum() * 0).backward()
    assert ours.decoder.layers["0"].mlp.router.weight.grad.abs().max() == 0


def _dense_probs(top_w: torch.Tensor, top_i: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(top_w.shape[0], experts).scatter(1, top_i, top_w)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.5])
def test_capacity_dropping_matches_megatron(capacity_factor: float) -> None:
    torch.manual_seed(7)
    n, e, k = 64, 8, 2
    probs = torch.softmax(torch.randn(n, e) * 2, dim=-1)
    top_w, top_i = torch.topk(probs, k, dim=-1)
    dense = _dense_probs(top_w, top_i, e)
    _, ref_map = apply_router_token_dropping(dense, dense > 0, k, capacity_factor, drop_policy="probs")
    cap = expert_capacity(n, e, k, capacity_factor)
    keep = capacity_keep(top_i.reshape(-1), top_w.reshape(-1), e, cap)
    ours_map = _dense_probs(keep.view(n, k).float(), top_i, e) > 0
    assert torch.equal(ours_map, ref_map)
    assert (ours_map.sum(0) <= cap).all() and ((~keep).any() or capacity_factor > 1)


def test_moe_layer_with_capacity_drops_like_megatron() -> None:
    """Dropped (token, expert) pairs contribute nothing; kept ones keep their (un-renormalised) weight."""
    cfg = preset("qwen3-moe-tiny").replace(vocab_size=VOCAB, moe_expert_capacity_factor=0.75)
    layer = MoELayer(cfg)
    torch.manual_seed(8)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    x = torch.randn(1, 40, cfg.hidden_size)
    with torch.no_grad():
        out = layer(x)
        _, top_w, top_i = layer.route(x[0])
        dense = _dense_probs(top_w, top_i, cfg.num_experts)
        final_probs, final_map = apply_router_token_dropping(dense, dense > 0, cfg.moe_router_topk, 0.75)
        w1, w2 = layer.experts.linear_fc1.weight, layer.experts.linear_fc2.weight
        ref = torch.zeros_like(x[0])
        for t, e in final_map.nonzero().tolist():
            gate, up = (w1[e] @ x[0, t]).chunk(2)
            ref[t] += final_probs[t, e] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    assert not final_map.sum(1).eq(cfg.moe_router_topk).all()  # something was dropped
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
    assert router_metrics(layer).summary()["dropped_token_fraction"] > 0  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["bmm", "grouped_mm", "padded"])
def test_expert_backends_agree(backend: str) -> None:
    cfg = preset("qwen3-moe-tiny").replace(vocab_size=VOCAB)
    torch.manual_seed(9)
    layers = [MoELayer(cfg) for _ in range(2)]
    for p in layers[0].parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    layers[1].load_state_dict(layers[0].state_dict())
    layers[0].experts.backend, layers[1].experts.backend = "loop", backend
    x = torch.randn(2, 16, cfg.hidden_size)
    grads = []
    outs = []
    for layer in layers:
        xi = x.clone().requires_grad_()
        out = layer(xi)
        (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        outs.append(out.detach())
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)  # fp32 summation order of mm vs bmm
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1, atol=2e-5, rtol=1e-5)


def test_router_metrics_count_tokens_and_skip_checkpoint_recompute() -> None:
    cfg = preset("qwen3-moe-tiny").replace(vocab_size=VOCAB)
    layer = MoELayer(cfg)
    torch.manual_seed(10)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    x = torch.randn(2, 8, cfg.hidden_size, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # the recompute in backward is not counted
    layer(x.detach())
    m = router_metrics(layer)
    assert m is not None and m.forwards == 2
    assert m.tokens_per_expert.sum().item() == 2 * 16 * cfg.moe_router_topk
    s = m.summary()
    t = m.tokens_per_expert[0]
    assert s["expert_load_imbalance"][0] == pytest.approx((t.max() / t.mean()).item())
    with torch.no_grad():
        probs, _, top_i = layer.route(x.detach().reshape(16, -1))
    tokens = torch.bincount(top_i.reshape(-1), minlength=cfg.num_experts).float()
    expected = cfg.num_experts / (cfg.moe_router_topk * 16**2) * (probs.sum(0) * tokens).sum()  # Megatron's formula
    assert s["load_balancing_loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert router_metrics(layer) is None  # reset


def test_init_weights_seeded_and_meta_device_build() -> None:
    cfg = preset("qwen3-moe-tiny").replace(vocab_size=1024)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    assert model.decoder.layers["0"].mlp.experts.linear_fc1.weight.is_meta
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    twin = Qwen3Model(cfg)
    twin.init_weights(seed=3)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name
    fc2 = model.decoder.layers["0"].mlp.experts.linear_fc2.weight
    assert fc2.shape == (8, 64, 32)
    assert abs(fc2.std().item() - 0.02 / (2 * cfg.num_layers) ** 0.5) < 0.001
    assert abs(model.decoder.layers["2"].mlp.router.weight.std().item() - 0.02) < 0.003
    assert isinstance(model.decoder.layers["1"].mlp, torch.nn.Module) and not isinstance(
        model.decoder.layers["1"].mlp, MoELayer
    )
    out = model(torch.randint(0, 1024, (1, 5)))
    assert out.shape == (1, 5, 1024) and torch.isfinite(out).all()


def test_config_from_and_to_hf() -> None:
    _, ours = hf_pair(decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6)
    cfg = ours.cfg
    assert cfg.moe_layers == [1, 5] and cfg.moe_router_topk == 2 and cfg.expert_ffn_hidden_size == 16
    again = ModelConfig.from_hf(cfg.to_hf())
    assert again == cfg
    assert cfg.to_hf()["architectures"] == ["Qwen3MoeForCausalLM"]
    assert ModelConfig.from_hf({**cfg.to_hf(), "num_experts": None, "num_local_experts": 8}).num_experts == 8
    assert sum(p.numel() for p in ours.parameters()) == cfg.num_params()
    assert ModelConfig(**{**cfg.__dict__, "moe_layer_freq": list(cfg.moe_layer_freq)}) == cfg  # JSON round trip


def test_published_moe_presets() -> None:
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B activated; Qwen3-235B-A22B: 235B, 22B (the model cards)."""
    a3b, a22b = preset("qwen3-30b-a3b"), preset("qwen3-235b-a22b")
    assert round(a3b.num_params() / 1e9, 1) == 30.5 and round(a3b.num_params(active=True) / 1e9, 1) == 3.4
    assert round(a22b.num_params() / 1e9) == 235 and round(a22b.num_params(active=True) / 1e9) == 22
    assert a3b.moe_layers == list(range(48)) and a3b.expert_ffn_hidden_size == 768


@pytest.mark.parametrize(
    "bad", [{"moe_router_topk": 9}, {"moe_layer_freq": (1, 0)}, {"moe_expert_capacity_factor": 0.0}]
)
def test_bad_moe_config_names_the_field(bad: dict) -> None:
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        preset("qwen3-moe-tiny").replace(**bad)
