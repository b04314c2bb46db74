"""Run under torchrun (world = TP × EP, PP 1): build Megatron-Core's own Qwen3-MoE-shaped GPTModel (local spec,
SequentialMLP or GroupedMLP experts, dense layers by ``moe_layer_freq``) for this rank and check that our converted
``mp_rank_TT[_EEE]`` file holds exactly its keys and shapes and loads into it; GroupedMLP's weights, viewed as its
forward views them, must be each local expert's transposed TP piece. With TP = EP = 1 and SequentialMLP, Megatron's
forward on CPU must give transformers' logits.

argv: <checkpoint dir> <tp> <ep> <grouped 0/1> <config json> <reference.pt>. Prints one JSON line per rank; exits 1
on any mismatch.
"""

import contextlib
import json
import os
import sys
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore")


def _model(tp: int, ep: int, grouped: bool, shape: dict) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None  # the kernel is only needed by forward
    cfg = TransformerConfig(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        ffn_hidden_size=shape["ffn_hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_query_groups"],
        kv_channels=shape["kv_channels"],
        num_moe_experts=shape["num_experts"],
        moe_router_topk=shape["topk"],
        moe_ffn_hidden_size=shape["moe_ffn_hidden_size"],
        moe_layer_freq=shape["moe_layer_freq"],
        moe_grouped_gemm=grouped,
        moe_token_dispatcher_type="allgather",  # alltoall allocates CUDA streams
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
        expert_model_parallel_size=ep,
        layernorm_epsilon=1e-6,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        cfg,
        get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm"),
        vocab_size=shape["vocab_size"],
        max_sequence_length=128,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=shape["rotary_base"],
        parallel_output=False,
    )


def main() -> int:
    ckpt, tp, ep, grouped = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    shape, ref = json.loads(sys.argv[5]), torch.load(sys.argv[6])
    from megatron.core import parallel_state as ps

    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    model = _model(tp, ep, grouped, shape)
    t, e = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    rank_dir = f"mp_rank_{t:02d}" + (f"_{e:03d}" if ep > 1 else "")
    path = os.path.join(ckpt, "iter_0000001", rank_dir, "model_optim_rng.pt")
    ours = torch.load(path, map_location="cpu", weights_only=False)["model"]
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    theirs = {k: v for k, v in theirs.items() if not k.endswith(("expert_bias", "local_tokens_per_expert"))}
    mine = {k: tuple(v.shape) for k, v in ours.items()}
    result = model.load_state_dict(ours, strict=False)
    missing = [k for k in result.missing_keys if k in theirs]
    ok = theirs == mine and not missing and not result.unexpected_keys
    if ok and grouped:
        ok = _grouped_views_match(model, ref, shape, t, tp, e, ep)
    print(
        json.dumps(
            {
                "rank": dist.get_rank(),
                "dir": rank_dir,
                "ok": ok,
                "only_megatron": sorted(set(theirs) - set(mine)),
                "only_ours": sorted(set(mine) - set(theirs)),
                "missing": missing,
                "unexpected": result.unexpected_keys,
            }
        ),
        flush=True,
    )
    if ok and tp == ep == 1 and not grouped:
        ok = _forward_matches(model, ref)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def _grouped_views_match(model: torch.nn.Module, ref: dict, shape: dict, t: int, tp: int, e: int, ep: int) -> bool:
    """GroupedMLP's forward views ``weight1`` as (E_local, H, -1) and ``weight2`` as (E_local, -1, H): expert j's
    slices must be the transposes of HF expert (e·E/EP + j)'s TP piece: [gate_t; up_t] and down_proj[:, t-th]."""
    experts = model.decoder.layers[0].mlp.experts
    n, h = shape["num_experts"] // ep, shape["hidden_size"]
    w1, w2 = experts.weight1.view(n, h, -1), experts.weight2.view(n, -1, h)
    for j in range(n):
        g = e * n + j
        gate, up, down = (ref["experts"][g][name] for name in ("gate", "up", "down"))
        fc1 = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
        if not (torch.equal(w1[j].t(), fc1) and torch.equal(w2[j].t(), down.chunk(tp, dim=1)[t])):
            return False
    return True


def _forward_matches(model: torch.nn.Module, ref: dict) -> bool:
    """The CPU substitutions (docs/megatron-moe.md §7), then Megatron's logits against transformers'."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax

    torch.cuda.current_device = lambda: "cpu"
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    tracker = SimpleNamespace(fork=lambda *args, **kwargs: contextlib.nullcontext())
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: tracker
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None  # 0.16.1 names it only when TransformerEngine imports; None = the torch path
    ids = ref["ids"]
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        logits = model.eval()(ids, positions, None)
    diff = (logits.float() - ref["logits"]).abs().max().item()
    print(json.dumps({"rank": dist.get_rank(), "max_logit_diff": diff}), flush=True)
    return diff < 1e-4


if __name__ == "__main__":
    sys.exit(main())
