"""MoE forward+backward throughput: our grouped-expert MoE layer vs transformers' ``Qwen3MoeSparseMoeBlock``, and a
full tiny Qwen3-MoE training step (forward, loss, backward) vs ``Qwen3MoeForCausalLM``, same weights, same run.

Shape (tiny but wide, as the real ones are wide: Qwen3-30B-A3B has 128 experts, top-8, expert FFN 768): hidden 256,
64 experts, top-8, expert FFN 128, ``--tokens`` tokens (default 4096, as 2 × 2048). The layer side feeds the same
input and output gradient to both blocks and checks that outputs agree. The model side: 2 MoE layers, 4 heads of 64
(2 KV groups), vocabulary 4096; ours computes the chunked cross-entropy from hidden states, transformers its logits
loss (``output_router_logits`` off, so neither adds an aux loss). Note: transformers 5 runs its full MoE models'
experts through ``torch._grouped_mm`` by default; only the standalone block runs the per-expert loop, so the layer
line also reports that block with ``experts_implementation="grouped_mm"`` (``vs_hf_grouped_mm_ratio``).

Timing: both sides in this process, one intra-op thread by default (``--threads``; on a shared machine a second
thread makes each op wait for the slower one), one warm-up, then ``--repeats`` timed runs per side interleaved;
tokens/s = tokens / the median run; the ratios are the median over the rounds of each round's ratio, with min, max
and count (``bench/common/pairs.py``). Our layer is also timed with each expert-matmul backend
(``grouped_mm`` = torch._grouped_mm, ``loop`` over non-empty experts, padded ``bmm``); all variants are timed
interleaved with the transformers block; the ratios use the automatic choice (``engine.model.moe.grouped_backend``),
which is what the model runs.
Prints one JSON line per measurement, the last line one JSON object with ``tokens_per_s_ratio`` (layer, target >= 2)
and ``model_tokens_per_s_ratio``. Run: ``.venv/bin/python bench/moe_step.py`` (about a minute on CPU);
``--device cuda`` runs bf16 on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common.pairs import pair_ratios  # noqa: E402

from engine.contract.model_config import ModelConfig
from engine.model.loss import chunked_cross_entropy
from engine.model.moe import MoELayer, grouped_backend
from engine.model.moe_mapping import native_from_hf
from engine.model.qwen3 import Qwen3Model

HIDDEN, EXPERTS, TOPK, EXPERT_FFN, VOCAB = 256, 64, 8, 128, 4096


def hf_config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        moe_intermediate_size=EXPERT_FFN,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        norm_topk_prob=True,
        mlp_only_layers=[],
        decoder_sparse_step=1,
        max_position_embeddings=8192,
        initializer_range=0.02,
        output_router_logits=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def best_time(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of one run: on CPU the thread's own CPU time (one intra-op thread), so that time spent waiting for
    a core on a shared machine is not counted; on an accelerator the wall time around a synchronize."""
    clock = time.perf_counter if device.type != "cpu" else time.thread_time
    sync(device)
    start = clock()
    fn()
    sync(device)
    return clock() - start


def interleaved(sides: dict[str, Callable[[], None]], repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per side and round; one warm-up each, then every side once a round, so that a load change hits the
    sides of a round alike: the ratios are taken round by round (``bench/common/pairs.py``)."""
    for fn in sides.values():
        best_time(fn, device)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            times[name].append(best_time(fn, device))
    return times


def per_round(times: dict[str, list[float]], name: str, slow: str, fast: str) -> dict[str, float | int]:
    """The median over the rounds of ``slow``'s time / ``fast``'s (a tokens/s ratio of fast over slow), with spread."""
    return pair_ratios(name, [a / b for a, b in zip(times[slow], times[fast], strict=True)])


def layer_bench(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_cfg = hf_config(1)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    torch.manual_seed(0)
    ours = MoELayer(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        ours.router.weight.normal_(0.0, 0.5)
        ours.experts.linear_fc1.weight.normal_(0.0, 0.05)
        ours.experts.linear_fc2.weight.normal_(0.0, 0.05)
    ours.aux_loss_coeff = 0.0  # the HF block has no aux loss inside: compare the same work
    hf = Qwen3MoeSparseMoeBlock(hf_cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.weight)
        hf.experts.gate_up_proj.copy_(ours.experts.linear_fc1.weight)  # (E, 2F, H): [gate; up] per expert in both
        hf.experts.down_proj.copy_(ours.experts.linear_fc2.weight)
    # transformers' own grouped path (its full models default to it; the standalone block runs the expert loop)
    grouped_cfg = hf_config(1)
    grouped_cfg._experts_implementation = "grouped_mm"
    hf_grouped = Qwen3MoeSparseMoeBlock(grouped_cfg).to(device=device, dtype=dtype)
    hf_grouped.load_state_dict(hf.state_dict())
    x = torch.randn(1, args.tokens, HIDDEN, device=device, dtype=dtype)
    grad = torch.randn_like(x)

    def run(block: torch.nn.Module, backend: str | None = None) -> Callable[[], None]:
        def fn() -> None:
            if isinstance(block, MoELayer):
                block.experts.backend = backend
            xi = x.detach().requires_grad_()
            block(xi).backward(grad)
            block.zero_grad(set_to_none=True)

        return fn

    with torch.no_grad():
        diff = (ours(x) - hf(x)).abs().max().item()
    auto = grouped_backend(x, HIDDEN, 2 * EXPERT_FFN, EXPERT_FFN)
    sides = {"hf": run(hf), "hf_grouped_mm": run(hf_grouped), "ours": run(ours)}
    sides |= {b: run(ours, b) for b in ("grouped_mm", "bmm", "loop")}
    rounds = interleaved(sides, args.repeats, device)
    times = {name: statistics.median(t) for name, t in rounds.items()}
    backends = {b: round(args.tokens / times[b], 1) for b in ("grouped_mm", "bmm", "loop")}
    result = {
        "what": "moe_layer_fwd_bwd",
        "tokens": args.tokens,
        "backend": auto,
        "max_abs_diff_vs_hf": diff,
        "ours_tokens_per_s": round(args.tokens / times["ours"], 1),
        "hf_tokens_per_s": round(args.tokens / times["hf"], 1),
        "hf_grouped_mm_tokens_per_s": round(args.tokens / times["hf_grouped_mm"], 1),
        "ours_tokens_per_s_by_backend": backends,
    }
    return (
        result
        | per_round(rounds, "tokens_per_s_ratio", "hf", "ours")
        | per_round(rounds, "vs_hf_grouped_mm_ratio", "hf_grouped_mm", "ours")
    )


def model_bench(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(1)
    hf = Qwen3MoeForCausalLM(hf_config(2)).to(device=device, dtype=dtype)
    cfg = ModelConfig.from_hf(hf.config.to_dict()).replace(moe_aux_loss_coeff=0.0)
    ours = Qwen3Model(cfg)
    state = {k: v for k, v in hf.state_dict().items()}
    ours.load_state_dict(dict(native_from_hf(_disk_names(state), cfg)))
    ours.to(device=device, dtype=dtype).train()
    hf.train()
    seq = args.tokens // 2
    ids = torch.randint(0, VOCAB, (2, seq), device=device)

    def ours_step() -> None:
        hidden = ours(ids, return_hidden=True)
        loss_sum, n = chunked_cross_entropy(hidden[:, :-1], ours.output_weight(), ids[:, 1:])
        (loss_sum / n).backward()
        ours.zero_grad(set_to_none=True)

    def hf_step() -> None:
        hf(ids, labels=ids).loss.backward()
        hf.zero_grad(set_to_none=True)

    rounds = interleaved({"hf": hf_step, "ours": ours_step}, max(2, args.repeats // 2), device)
    times = {name: statistics.median(t) for name, t in rounds.items()}
    tokens = 2 * seq
    return {
        "what": "moe_model_step",
        "tokens": tokens,
        "layers": 2,
        "ours_tokens_per_s": round(tokens / times["ours"], 1),
        "hf_tokens_per_s": round(tokens / times["hf"], 1),
        **per_round(rounds, "tokens_per_s_ratio", "hf", "ours"),
    }


def _disk_names(state: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """Published checkpoint names served from transformers' fused in-memory expert tensors."""

    def get(name: str) -> torch.Tensor:
        if ".mlp.experts." in name:
            base, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            prefix = base + ".mlp.experts."
            if proj == "down_proj":
                return state[prefix + "down_proj"][int(e)]
            gate, up = state[prefix + "gate_up_proj"][int(e)].chunk(2)
            return gate if proj == "gate_proj" else up
        return state[name]

    return get


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--smoke", action="store_true", help="256 tokens, two timed rounds: the same code path")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.repeats = 256, 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    layer = layer_bench(args, device, dtype)
    print(json.dumps(layer), flush=True)
    model = model_bench(args, device, dtype)
    print(json.dumps(model), flush=True)
    print(
        json.dumps(
            {
                "bench": "moe_step",
                "smoke": args.smoke,
                "device": device.type,
                "dtype": str(dtype).removeprefix("torch."),
                "threads": args.threads,
                "tokens": args.tokens,
                "experts": EXPERTS,
                "topk": TOPK,
                "hidden": HIDDEN,
                "expert_ffn": EXPERT_FFN,
                "backend": layer["backend"],
                **{k: v for k, v in layer.items() if k.startswith(("tokens_per_s_ratio", "vs_hf_grouped_mm_ratio"))},
                "ours_tokens_per_s": layer["ours_tokens_per_s"],
                "hf_tokens_per_s": layer["hf_tokens_per_s"],
                **{f"model_{k}": v for k, v in model.items() if k.startswith("tokens_per_s_ratio")},
                "model_ours_tokens_per_s": model["ours_tokens_per_s"],
                "model_hf_tokens_per_s": model["hf_tokens_per_s"],
            }
        )
    )


if __name__ == "__main__":
    main()
