"""Run under torchrun (world = TP × PP): build Megatron-Core's own GPTModel (local spec, qk-layernorm) for this
rank and check that our converted rank file holds exactly its keys and shapes and loads into it.

argv: <checkpoint dir> <tp> <pp> <config json> [<reference.pt>]. With a reference (``ids`` and transformers'
``logits``) and PP = 1, Megatron's forward on CPU must also give transformers' logits. Prints one JSON line per
rank; exits 1 on any mismatch.
"""

import json
import os
import sys
import warnings

import torch

import mcore_cpu_support as mcpu

warnings.filterwarnings("ignore")


def main() -> int:
    ckpt, tp, pp, shape = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mcpu.init_cpu_model_parallel(tp, pp)
    cfg = mcpu.cpu_transformer_config(shape, tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
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
    ok, report = mcpu.compare_rank_file(model, path, rank_dir)
    print(json.dumps(report), flush=True)
    if ok and len(sys.argv) > 5 and pp == 1:
        ok = mcpu.forward_matches(model, torch.load(sys.argv[5]))
    return mcpu.finish(ok)


if __name__ == "__main__":
    sys.exit(main())
