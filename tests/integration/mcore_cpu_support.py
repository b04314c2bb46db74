"""Shared helpers of the Megatron-Core oracle workers (not a test module): the one place that lets Megatron-Core's
own GPTModel build, load and run forward on CPU under gloo (docs/megatron-core-on-cpu.md, docs/megatron-moe.md §7), and
the key/shape comparison of one of our converted rank files against it. Megatron is imported inside the functions:
the tests import ``mcore_shape`` before they know whether it is installed."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def mcore_shape(cfg: Any, **extra: Any) -> dict[str, Any]:
    """The attention/FFN shape of our ``ModelConfig`` as the workers pass it to ``TransformerConfig``, plus ``extra``."""
    return {
        "num_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_query_groups": cfg.num_query_groups,
        "kv_channels": cfg.kv_channels,
        **extra,
    }


def init_cpu_model_parallel(tp: int, pp: int = 1, ep: int = 1) -> None:
    """``.cuda()`` a no-op (tied embeddings with PP > 1: Megatron all-reduces the output copy after ``.cuda()``; on
    CPU it stays put), the gloo group, then Megatron's TP × PP (× EP) groups."""
    from megatron.core import parallel_state as ps

    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)


def cpu_transformer_config(shape: dict[str, Any], tp: int, **extra: Any) -> Any:
    """Megatron's ``TransformerConfig`` of a Qwen3 (RMSNorm, qk-layernorm, SwiGLU, no biases) built on CPU with every
    fused kernel off and no dropout; ``extra`` adds the pipeline or MoE settings."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        ffn_hidden_size=shape["ffn_hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_query_groups"],
        kv_channels=shape["kv_channels"],
        use_cpu_initialization=True,
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        layernorm_epsilon=1e-6,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **extra,
    )


def compare_rank_file(
    model: torch.nn.Module, path: str, rank_dir: str, skip: tuple[str, ...] = ()
) -> tuple[bool, dict[str, Any]]:
    """Load our rank file ``path`` into ``model``: ok when its keys and shapes are exactly the model's (less
    ``_extra_state`` and the ``skip`` suffixes) and it loads with none of those missing and nothing unexpected. Also
    the report line's fields."""
    ours = torch.load(path, map_location="cpu", weights_only=False)["model"]
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    theirs = {k: v for k, v in theirs.items() if not k.endswith(skip)} if skip else theirs
    mine = {k: tuple(v.shape) for k, v in ours.items()}
    result = model.load_state_dict(ours, strict=False)
    missing = [k for k in result.missing_keys if k in theirs]
    ok = theirs == mine and not missing and not result.unexpected_keys
    return ok, {
        "rank": dist.get_rank(),
        "dir": rank_dir,
        "ok": ok,
        "only_megatron": sorted(set(theirs) - set(mine)),
        "only_ours": sorted(set(mine) - set(theirs)),
        "shape_diff": {k: [theirs[k], mine[k]] for k in theirs.keys() & mine.keys() if theirs[k] != mine[k]},
        "missing": missing,
        "unexpected": result.unexpected_keys,
    }


def cpu_forward_substitutions(moe: bool = False) -> None:
    """What Megatron's forward needs on CPU: a device name, the causal mask it would take from a CUDA kernel, an RNG
    tracker that forks nothing; with MoE, the torch path of the expert GEMM."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    tracker = SimpleNamespace(fork=lambda *args, **kwargs: contextlib.nullcontext())
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: tracker
    if moe:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.te_general_gemm = None  # 0.16.1 names it only when TransformerEngine imports; None = the torch path


def forward_matches(model: torch.nn.Module, ref: dict[str, Any], moe: bool = False) -> bool:
    """The CPU substitutions, then Megatron's logits on ``ref["ids"]`` within 1e-4 of transformers' ``ref["logits"]``
    (printed as this rank's ``max_logit_diff`` line)."""
    cpu_forward_substitutions(moe)
    ids = ref["ids"]
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        logits = model.eval()(ids, positions, None)
    diff = (logits.float() - ref["logits"]).abs().max().item()
    print(json.dumps({"rank": dist.get_rank(), "max_logit_diff": diff}), flush=True)
    return diff < 1e-4


def finish(ok: bool) -> int:
    """Wait for every rank, leave the group; the worker's exit status."""
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1
