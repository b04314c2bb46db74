"""Shared helpers of the stage grpo tests (not a test module): a tiny transformers Qwen3 with the real vocabulary,
and instruction data of chat prompts with short answers (the prompt is what the rollout samples from)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.contract.indexed import IndexedDatasetWriter, instruction_prefix

QUESTIONS = ["Say yes or no.", "Name a colour.", "What is 2+2?", "Greet me."]
ANSWERS = ["yes", "blue", "4", "hello"]


def tiny_qwen3(moe: bool = False) -> Any:
    """A random-weight ``Qwen3ForCausalLM``: 2 layers, width 32, 4 heads over 2 KV groups, the 151,936-token
    vocabulary (the real tokenizer's ids), an untied head; ``moe``: a ``Qwen3MoeForCausalLM`` whose layers both
    route to 4 experts (top 2, FFN 32). Seed it before calling."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape: dict[str, Any] = {
        "vocab_size": 151936, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": False,
    }  # fmt: skip
    if not moe:
        return Qwen3ForCausalLM(Qwen3Config(**shape))
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": []}
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, **experts, norm_topk_prob=True))


def write_prompts(prefix: Path, tokenizer_dir: Path) -> None:
    """``QUESTIONS`` in the Qwen3 chat template with ``ANSWERS`` as the labelled assistant turn, as indexed
    instruction data at ``prefix``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    fields = ("input_ids", "attention_mask", "labels")
    writers = {f: IndexedDatasetWriter(instruction_prefix(prefix, f)) for f in fields}
    for question, answer in zip(QUESTIONS, ANSWERS, strict=True):
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt, reply = tok.encode(text), tok.encode(answer + "<|im_end|>")
        writers["input_ids"].add_document(np.array(prompt + reply))
        writers["attention_mask"].add_document(np.ones(len(prompt) + len(reply)))
        writers["labels"].add_document(np.array([-100] * len(prompt) + reply))
    for w in writers.values():
        w.finalize()
