"""Activation memory of one decoder layer: bytes kept for backward per token, ours vs transformers vs Megatron.

Shapes: a Qwen3-4B decoder layer (hidden 2560, 32/8 heads of 128, FFN 9728) and a Qwen3-30B-A3B MoE layer (hidden
2048, 32/4 heads, 128 experts, top-8, expert FFN 768), bf16, one sequence of ``--seq`` tokens.

What is counted, per mode:
- no recompute: the tensors autograd saves in the layer's forward, through ``torch.autograd.graph.
  saved_tensors_hooks``, unique storages, sized at the end of the forward (the SwiGLU product our MLP frees after
  fc2 counts 0), parameters and the shared RoPE tables left out. The same for transformers' ``Qwen3DecoderLayer``.
- selective / full (``engine.parallel.activation_checkpoint``): a checkpointed layer saves through its own hooks
  and caches, which an outer hook cannot see, so these count the storages created in the forward that are still
  alive after it (a ``TorchFunctionMode`` records each result's storage by weak reference), the output left out.
The dense layer runs on the meta device (no arithmetic). One substitution: on meta, ``scaled_dot_product_attention``
always takes its math reference path (fp32 (heads, T, T) scores kept for backward) because the backend choice has
no meta rule, so here it calls the fused kernel a real run dispatches to (``_scaled_dot_product_flash_attention_
for_cpu``, the CPU flash kernel; it saves what CUDA's flash and NPU's fusion kernel save: q, k, v, output, fp32
log-sum-exp), for both layers. The MoE layer cannot run on meta (``bincount`` and the expert counts need data), so
it runs on the CPU with real bf16 tensors (a fraction of a second of arithmetic at this size), its experts on the
grouped-matmul path accelerators take.

Figures: KB per token per layer (1 KB = 1000 B); ``vs_megatron`` = ours / Megatron's ``s·b·h·(18 + 4·ffn/h)``
(``megatron/training/theoretical_memory_usage.py`` ``compute_activation_memory``; for MoE ffn = top-k × expert FFN,
the rows a token runs through — for Qwen3-30B-A3B the same as its dense ``ffn_hidden_size`` 6144 = 8 × 768, which is
what Megatron's function reads), with the attention part written per width: the function takes every attention
tensor as h wide (its own TODO: "needs to take into account query_projection_size potentially being different from
hidden_size"); its 11·h of attention (Korthikanti et al. 2022, Table 2: the QKV input 2h, Q and K 4h, V 2h, the
output projection's input 2h, the dropout mask h) is counted here as 3·h + 4·q + 4·kv (q, kv: the query and the
key/value projection widths). For Qwen3-4B (q 4096, kv 1024, h 2560) that is exactly 11·h, so the dense baseline is
the literal formula; Qwen3-30B-A3B's queries are 2·h wide (4096 for h 2048), +2 KB per token over the literal
figure, which is reported too (``megatron_literal_kb``). Target <= 1.1 without recompute; ``vs_transformers`` = ours / transformers' (target <= 0.6);
``planner_vs_measured`` = ``engine.contract.plan.memory``'s figure / ours (target within 1 ± 0.05). The last line is one JSON
object. ``--smoke``: 128 tokens and 16 experts (seconds).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.contract.model_config import ModelConfig, preset
from engine.contract.plan.memory import Layout, layer_activation_bytes, stage_activation_bytes
from engine.model.attention import plan_attention
from engine.model.moe import GroupedExperts
from engine.model.qwen3 import Qwen3Model
from engine.model.rope import rope_cos_sin
from engine.parallel.activation_checkpoint import apply_ac

MODES = ("none", "selective", "full")


def _fused_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001, ANN202
    """What SDPA runs on real tensors (the flash kernel), callable on meta; takes fewer KV heads as they are."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def saved_by_hooks(run: Callable[[], Any], skip: set[int]) -> int:
    """Bytes of the unique storages autograd saves while ``run`` executes (sized after it)."""
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _storage_key(t) not in skip:
            seen[_storage_key(t)] = t.untyped_storage()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(s.nbytes() for s in seen.values())


class _Created(TorchFunctionMode):
    """Weak references to the storage of every tensor an op returns, with its size at creation."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.made.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
        return out


def alive_after_forward(run: Callable[[], torch.Tensor], skip: set[int]) -> int:
    """Bytes of the storages created during ``run`` that are still alive after it, its output left out."""
    mode = _Created()
    with mode:
        out = run()
    skip = skip | {_storage_key(out)}
    gc.collect()
    alive = sum(n for key, (ref, n) in mode.made.items() if key not in skip and not ref.expired())
    del out
    return alive


def _layer_model(cfg: ModelConfig, device: str, mode: str) -> Qwen3Model:
    layer = cfg.moe_layers[0] if cfg.moe_layers else 0
    with torch.device(device):
        model = Qwen3Model(cfg, layers=[layer], embedding=False, head=False).to(torch.bfloat16)
    if device != "meta":
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.backend = "grouped_mm"  # the accelerators' path (CPU's default per-expert loop saves the same)
    if mode != "none":
        apply_ac(model, mode)
    return model


def measure_ours(cfg: ModelConfig, device: str, mode: str, seq: int) -> float:
    model = _layer_model(cfg, device, mode)
    layer = next(iter(model.decoder.layers.values()))
    x = torch.randn(1, seq, cfg.hidden_size, dtype=torch.bfloat16, device=device, requires_grad=True)
    rope = rope_cos_sin(torch.arange(seq, device=device)[None], cfg, x.dtype)
    plan = plan_attention(x.device, seq, batch=1)
    skip = {_storage_key(p) for p in model.parameters()} | {_storage_key(t) for t in rope}
    if mode == "none":
        return saved_by_hooks(lambda: layer(x, rope, plan), skip) / seq
    # the checkpoint keeps the layer's input (created outside, so not among the storages counted)
    kept_input = x.untyped_storage().nbytes()
    return (alive_after_forward(lambda: layer(x, rope, plan), skip) + kept_input) / seq


def measure_transformers(cfg: ModelConfig, seq: int) -> float:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    hf = Qwen3Config(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type")})
    hf._attn_implementation = "sdpa"
    with torch.device("meta"):
        layer = Qwen3DecoderLayer(hf, 0).to(torch.bfloat16)
        x = torch.randn(1, seq, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        pos = torch.arange(seq)[None]
        cos, sin = Qwen3RotaryEmbedding(hf)(x, pos)
    skip = {_storage_key(p) for p in layer.parameters()} | {_storage_key(t) for t in (cos, sin)}
    return saved_by_hooks(lambda: layer(x, position_embeddings=(cos, sin), position_ids=pos), skip) / seq


def planned(cfg: ModelConfig, mode: str, seq: int) -> float:
    """The planner's bytes per token for one layer (flash-kernel attention, as measured here)."""
    lay = Layout(seq_length=seq, compute_bytes=2, device_type="npu", recompute=None if mode == "none" else mode)
    if mode == "none":
        return layer_activation_bytes(cfg, lay, seq) / seq
    # one layer's kept bytes: stage_activation_bytes less the per-forward RoPE tables it adds
    return (stage_activation_bytes(cfg, lay, 1, seq) - 2 * seq * cfg.kv_channels * 2) / seq


def megatron_literal(cfg: ModelConfig) -> float:
    ffn = cfg.moe_router_topk * cfg.expert_ffn_hidden_size if cfg.moe_layers else cfg.ffn_hidden_size
    return cfg.hidden_size * (18 + 4 * ffn / cfg.hidden_size)


def megatron(cfg: ModelConfig) -> float:
    """The literal formula with its 11·h of attention counted per width (3·h + 4·q + 4·kv; module docstring)."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
    return megatron_literal(cfg) - 11 * h + 3 * h + 4 * q + 4 * kv


def bench_layer(name: str, cfg: ModelConfig, device: str, seq: int, with_hf: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "layer": name,
        "device": device,
        "tokens": seq,
        "megatron_kb": round(megatron(cfg) / 1e3, 2),
        "megatron_literal_kb": round(megatron_literal(cfg) / 1e3, 2),
    }
    for mode in MODES:
        ours = measure_ours(cfg, device, mode, seq)
        row = {
            "ours_kb": round(ours / 1e3, 2),
            "planner_kb": round(planned(cfg, mode, seq) / 1e3, 2),
            "vs_megatron": round(ours / megatron(cfg), 3),
            "planner_vs_measured": round(planned(cfg, mode, seq) / ours, 3),
        }
        if with_hf and mode == "none":
            theirs = measure_transformers(cfg, seq)
            row.update(transformers_kb=round(theirs / 1e3, 2), vs_transformers=round(ours / theirs, 3))
        out[mode] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048, help="tokens of the one sequence")
    parser.add_argument("--smoke", action="store_true", help="128 tokens, 16 experts: seconds")
    args = parser.parse_args()
    seq = 128 if args.smoke else args.seq
    F.scaled_dot_product_attention = _fused_sdpa  # see the module docstring
    dense = bench_layer("qwen3-4b", preset("qwen3-4b"), "meta", seq, with_hf=True)
    print(json.dumps(dense), flush=True)
    moe_cfg = preset("qwen3-30b-a3b")
    if args.smoke:
        moe_cfg = moe_cfg.replace(num_experts=16)
    torch.manual_seed(0)
    moe = bench_layer("qwen3-30b-a3b", moe_cfg, "cpu", min(seq, 512), with_hf=False)
    print(json.dumps(moe), flush=True)
    summary = {
        "vs_megatron": dense["none"]["vs_megatron"],
        "vs_transformers": dense["none"]["vs_transformers"],
        "planner_vs_measured": {m: dense[m]["planner_vs_measured"] for m in MODES},
        "moe_vs_megatron": moe["none"]["vs_megatron"],
        "moe_vs_megatron_literal": round(moe["none"]["ours_kb"] / moe["megatron_literal_kb"], 3),
        "moe_planner_vs_measured": {m: moe[m]["planner_vs_measured"] for m in MODES},
        "kb_per_token_per_layer": {m: dense[m]["ours_kb"] for m in MODES},
        "moe_kb_per_token_per_layer": {m: moe[m]["ours_kb"] for m in MODES},
        "transformers_kb_per_token_per_layer": dense["none"]["transformers_kb"],
        "megatron_kb_per_token_per_layer": dense["megatron_kb"],
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
