"""Run under torchrun (world = TP × EP, PP 1): build Megatron-Core's own Qwen3-MoE-shaped GPTModel (local spec,
SequentialMLP or GroupedMLP experts, dense layers by ``moe_layer_freq``) for this rank and check that our converted
``mp_rank_TT[_EEE]`` file holds exactly its keys and shapes and loads into it; GroupedMLP's weights, viewed as its
forward views them, must be each local expert's transposed TP piece. With TP = EP = 1 and SequentialMLP, Megatron's
forward on CPU must give transformers' logits.

argv: <checkpoint dir> <tp> <ep> <grouped 0/1> <config json> <reference.pt>. Prints one JSON line per rank; exits 1
on any mismatch.
"""

import json
import os
import sys
import warnings

import torch

import mcore_cpu_support as mcpu

warnings.filterwarnings("ignore")


def _model(tp: int, ep: int, grouped: bool, shape: dict) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None  # the kernel is only needed by forward
    cfg = mcpu.cpu_transformer_config(
        shape,
        tp,
        num_moe_experts=shape["num_experts"],
        moe_router_topk=shape["topk"],
        moe_ffn_hidden_size=shape["moe_ffn_hidden_size"],
        moe_layer_freq=shape["moe_layer_freq"],
        moe_grouped_gemm=grouped,
        moe_token_dispatcher_type="allgather",  # alltoall allocates CUDA streams
        expert_model_parallel_size=ep,
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

    mcpu.init_cpu_model_parallel(tp, ep=ep)
    model = _model(tp, ep, grouped, shape)
    t, e = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    rank_dir = f"mp_rank_{t:02d}" + (f"_{e:03d}" if ep > 1 else "")
    path = os.path.join(ckpt, "iter_0000001", rank_dir, "model_optim_rng.pt")
    ok, report = mcpu.compare_rank_file(model, path, rank_dir, skip=("expert_bias", "local_tokens_per_expert"))
    if ok and grouped:
        ok = report["ok"] = _grouped_views_match(model, ref, shape, t, tp, e, ep)
    print(json.dumps(report), flush=True)
    if ok and tp == ep == 1 and not grouped:
        ok = mcpu.forward_matches(model, ref, moe=True)
    return mcpu.finish(ok)


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


if __name__ == "__main__":
    sys.exit(main())
