"""Qwen3Model against transformers' Qwen3ForCausalLM on the same weights (fp32, CPU), packing and init."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from engine.contract.model_config import ModelConfig, preset
from engine.model import hf_mapping
from engine.model.loss import chunked_cross_entropy
from engine.model.qwen3 import Qwen3Model

VOCAB = 512


def small_cfg(tied: bool) -> ModelConfig:
    # 4 heads in 2 KV groups (GQA), head_dim 16 != hidden / heads, like the real models
    return ModelConfig(2, 48, 96, 4, 2, 16, vocab_size=VOCAB, tie_word_embeddings=tied, rotary_base=10000.0)


def hf_pair(cfg: ModelConfig, seed: int = 0) -> tuple[Qwen3ForCausalLM, Qwen3Model]:
    """A random HF model and our model loaded from its state dict through hf_mapping."""
    torch.manual_seed(seed)
    hf_cfg = {k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "torch_dtype")}
    hf_cfg.update(bos_token_id=None, eos_token_id=None)
    hf = Qwen3ForCausalLM(Qwen3Config(**hf_cfg, attn_implementation="eager")).eval()
    with torch.no_grad():  # HF inits norms to 1; random norms make the q/k-norm and final-norm mapping visible
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ours = Qwen3Model(cfg)
    sd = hf.state_dict()
    ours.load_state_dict(dict(hf_mapping.native_from_hf(sd.__getitem__, cfg)), strict=True)
    return hf, ours.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tied: bool) -> None:
    hf, ours = hf_pair(small_cfg(tied))
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("tied", [False, True])
def test_training_step_loss_and_grads_match_transformers(tied: bool) -> None:
    cfg = small_cfg(tied)
    hf, ours = hf_pair(cfg, seed=1)
    ids = torch.randint(0, VOCAB, (2, 20))
    labels = ids.clone()
    labels[0, :6] = -100  # a masked prompt
    ref = hf(ids, labels=labels).loss  # HF shifts labels inside and averages over counted tokens
    ref.backward()
    hidden = ours(ids, return_hidden=True)
    loss_sum, n = chunked_cross_entropy(hidden[:, :-1], ours.output_weight(), labels[:, 1:], chunk_size=8)
    loss = loss_sum / n
    loss.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    hf_grads.setdefault("lm_head.weight", hf_grads["model.embed_tokens.weight"])
    expected = dict(hf_mapping.native_from_hf(hf_grads.__getitem__, cfg))
    ours_grads = {k: p.grad for k, p in ours.named_parameters()}
    assert expected.keys() == ours_grads.keys()
    for key, g in expected.items():
        torch.testing.assert_close(ours_grads[key], g, atol=1e-5, rtol=1e-4, msg=key)


def test_packed_batch_matches_separate_samples() -> None:
    _, ours = hf_pair(small_cfg(tied=False), seed=2)
    lengths = [5, 8, 3]
    samples = [torch.randint(0, VOCAB, (n,)) for n in lengths]
    packed = torch.cat(samples)[None]  # (1, 16)
    segment_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        out = ours(packed, position_ids=position_ids, segment_ids=segment_ids)[0]
        alone = torch.cat([ours(s[None])[0] for s in samples])
    assert (out - alone).abs().max().item() <= 1e-5


def test_packed_and_unpacked_batches_give_the_same_loss() -> None:
    _, ours = hf_pair(small_cfg(tied=True), seed=3)
    a, b = torch.randint(0, VOCAB, (7,)), torch.randint(0, VOCAB, (7,))
    w = ours.output_weight()
    with torch.no_grad():
        h = ours(torch.stack([a, b]), return_hidden=True)
        unpacked, n1 = chunked_cross_entropy(h[:, :-1], w, torch.stack([a, b])[:, 1:])
        ids = torch.cat([a, b])[None]
        seg = torch.tensor([0] * 7 + [1] * 7)[None]
        pos = torch.cat([torch.arange(7), torch.arange(7)])[None]
        hp = ours(ids, position_ids=pos, segment_ids=seg, return_hidden=True)
        labels = torch.cat([a[1:], torch.tensor([-100]), b[1:], torch.tensor([-100])])[None]  # no cross-sample target
        packed, n2 = chunked_cross_entropy(hp, w, labels)
    assert n1.item() == n2.item() == 12
    assert abs(unpacked.item() - packed.item()) <= 1e-4


def test_forward_without_embedding_and_final_norm_passes_hidden_states() -> None:
    _, full = hf_pair(small_cfg(tied=False), seed=4)
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        expected = full(ids)
        first = Qwen3Model(full.cfg)
        first.load_state_dict(full.state_dict())
        del first.decoder.layers["1"]
        first.decoder.final_layernorm = None  # a first pipeline stage
        last = Qwen3Model(full.cfg)
        last.load_state_dict(full.state_dict())
        del last.decoder.layers["0"]
        last.embedding = None  # a last pipeline stage: hidden states in, logits out
        got = last(first(ids))
    assert (got - expected).abs().max().item() <= 1e-6
    assert "decoder.layers.1.mlp.linear_fc1.weight" in last.state_dict()  # global layer keys survive the split


def test_local_head_counts_come_from_shapes() -> None:
    """A TP-style shard (half the KV groups in linear_qkv, half the rows of linear_proj's input) still runs."""
    cfg = small_cfg(tied=False)
    layer = Qwen3Model(cfg).decoder.layers["0"].self_attention
    groups_local = cfg.num_query_groups // 2
    layer.linear_qkv = torch.nn.Linear(cfg.hidden_size, cfg.qkv_rows // 2, bias=False)
    layer.linear_proj = torch.nn.Linear(cfg.num_attention_heads * cfg.kv_channels // 2, cfg.hidden_size, bias=False)
    from engine.model.attention import plan_attention
    from engine.model.rope import rope_cos_sin

    x = torch.randn(1, 5, cfg.hidden_size)
    rope = rope_cos_sin(torch.arange(5)[None], cfg, x.dtype)
    out = layer(x, rope, plan_attention(x.device, 5))
    assert out.shape == x.shape and groups_local == 1


def test_init_weights_is_megatron_style_and_seeded() -> None:
    cfg = preset("qwen3-tiny").replace(vocab_size=4096)
    a, b = Qwen3Model(cfg), Qwen3Model(cfg)
    a.init_weights(seed=7)
    b.init_weights(seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert torch.all(a.decoder.final_layernorm.weight == 1)
    emb_std = a.embedding.word_embeddings.weight.std().item()
    proj_std = a.decoder.layers["0"].mlp.linear_fc2.weight.std().item()
    assert abs(emb_std - 0.02) < 0.002
    assert abs(proj_std - 0.02 / (2 * cfg.num_layers) ** 0.5) < 0.002


def test_meta_device_build_then_materialise() -> None:
    cfg = preset("qwen3-tiny-tied").replace(vocab_size=1024)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    out = model(torch.randint(0, 1024, (1, 4)))
    assert out.shape == (1, 4, 1024) and torch.isfinite(out).all()


def test_real_vocab_tiny_preset_matches_transformers() -> None:
    """The preset other components test with (real 151,936-word vocabulary) under the same parity bound."""
    hf, ours = hf_pair(preset("qwen3-tiny"), seed=5)
    ids = torch.randint(0, 151936, (1, 16))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= 1e-5


def test_bf16_forward_stays_close_to_fp32() -> None:
    _, ours = hf_pair(small_cfg(tied=True), seed=6)
    ids = torch.randint(0, VOCAB, (2, 16))
    seg = torch.tensor([[0] * 9 + [1] * 7, [0] * 16])
    with torch.no_grad():
        ref = ours(ids, segment_ids=seg).softmax(-1)
        low = ours.to(torch.bfloat16)(ids, segment_ids=seg)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
    assert (low.float().softmax(-1) - ref).abs().max().item() < 2e-2
