"""Token and label constants every engine stage shares, defined once so data, training, evaluation and conversion
cannot drift apart. Torch-free: the data pipeline and the planner import it without loading torch (torch dtype
names live in ``engine.dtypes``).
"""

from __future__ import annotations

IGNORE_INDEX = -100  # label of a token not in the loss (torch's cross_entropy default ignore_index)
PAD_ID = 0  # input id of right padding: never attended to (causal mask) and never in the loss

# Qwen3 tokenizer ids written into the config.json / generation_config.json we export.
QWEN3_ENDOFTEXT_ID = 151643  # <|endoftext|>: bos, pad
QWEN3_IM_END_ID = 151645  # <|im_end|>: end of a chat turn

# Serving (``engine.serve``): prompt tokens per prefill step, which bounds how long one long prompt holds the
# running sequences back; the planner sizes a serve job's activations by it.
SERVE_PREFILL_CHUNK = 512
SERVE_METRICS_INTERVAL_S = 5.0  # seconds between two deployment-metrics points (engine.serve.stats)

# Preference training (stage dpo): the losses that compare no reference model (LLaMA-Factory's names).
REFERENCE_FREE_LOSSES: frozenset[str] = frozenset({"simpo", "orpo"})
# Ring attention computes each K/V block's scores in row tiles of at most this many fp32 bytes (about four such
# buffers live at once in backward: scores, probabilities, their gradient, a product); the planner counts the same.
RING_SCORE_TILE_BYTES = 32 << 20
