"""Qwen3 dense and MoE decoder: math only. Parallelism is applied from outside (engine.parallel).

(``ModelConfig``, the presets and the LoRA target table are torch-free and live in ``engine.contract``.)
- ``moe``: Qwen3-MoE sparse MLP (router, grouped experts, load-balancing loss, token dropping, router metrics).
- ``moe_mapping``: HF <-> native names of the MoE tensors (to fold into ``hf_mapping``).
- ``qwen3``: Qwen3Model with Megatron-Core local-spec module names (fused ``linear_qkv`` / ``linear_fc1``).
- ``attention``: per-batch attention plan (causal / packed block mask / left padding / varlen kernels).
- ``kv_cache``: preallocated per-layer KV cache for decoding.
- ``sampling``: the next token from logits (greedy, temperature / top-k / top-p), eval's and serving's rule.
- ``decoder_lm``: ``DecoderLM``, what callers use of a family's model, and ``decoder_lm(model)`` to narrow to it.
- ``loss``: chunked cross-entropy over the head that never holds (tokens × vocab) logits.
- ``lora``: LoRA converter, adapter-only state dicts, merge.
- ``hf_mapping``: the one declarative native <-> HF key map (QKV interleave, fc1 [gate; up]) and what derives from it.
"""
