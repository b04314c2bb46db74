"""Run under torchrun (world = TP × PP): build Megatron-Core's own GPTModel (local spec, qk-layernorm) for this
rank and check that our converted rank file holds exactly its keys and shapes and loads into it.

argv: <checkpoint dir> <tp> <pp> <config json> [<reference.pt>]. With a reference (``ids`` and transformers'
``logits``) and PP = 1, Megatron's forward on CPU must also give transformers' logits. Prints one JSON line per
rank; exits 1 on any mismatch.
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


def main() -> int:
    ckpt, tp, pp, shape = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    # Tied embeddings with PP > 1: Megatron all-reduces the output copy after ``.cuda()``; on CPU it stays put.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tp, pp)
    cfg = TransformerConfig(
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
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        layernorm_epsilon=1e-6,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
        vocab_size=shape["vocab_size"],
        max_sequence_length=128,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=shape["tie_word_embeddings"],
        position_embedding_type="rope",
        rotary_base=shape.get("rotary_base", 10000),
        parallel_output=False,
    )
    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    tracker = open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip()
    path = os.path.join(ckpt, f"iter_{int(tracker):07d}", rank_dir, "model_optim_rng.pt")
    ours = torch.load(path, map_location="cpu", weights_only=False)["model"]
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    mine = {k: tuple(v.shape) for k, v in ours.items()}
    result = model.load_state_dict(ours, strict=False)
    bad_missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    ok = theirs == mine and not bad_missing and not result.unexpected_keys
    print(
        json.dumps(
            {
                "rank": dist.get_rank(),
                "dir": rank_dir,
                "ok": ok,
                "only_megatron": sorted(set(theirs) - set(mine)),
                "only_ours": sorted(set(mine) - set(theirs)),
                "shape_diff": {k: [theirs[k], mine[k]] for k in theirs.keys() & mine.keys() if theirs[k] != mine[k]},
                "missing": bad_missing,
                "unexpected": result.unexpected_keys,
            }
        ),
        flush=True,
    )
    if ok and len(sys.argv) > 5 and pp == 1:
        ok = _forward_matches(model, sys.argv[5])
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def _forward_matches(model: torch.nn.Module, reference: str) -> bool:
    """The three CPU substitutions of megatron-core-on-cpu.md, then Megatron's logits against transformers'."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax

    torch.cuda.current_device = lambda: "cpu"
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    tracker = SimpleNamespace(fork=lambda *args, **kwargs: contextlib.nullcontext())
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: tracker
    ref = torch.load(reference)
    ids = ref["ids"]
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        logits = model.eval()(ids, positions, None)
    diff = (logits.float() - ref["logits"]).abs().max().item()
    print(json.dumps({"rank": dist.get_rank(), "max_logit_diff": diff}), flush=True)
    return diff < 1e-4


if __name__ == "__main__":
    sys.exit(main())
