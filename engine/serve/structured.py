"""Structured output: a request's JSON schema, regex, choice or Lark grammar enforced while decoding, by masking the
tokens that cannot continue it before each sample.

The grammar engine is llguidance (``pip install llguidance``): one abi3 wheel with no Python dependencies (xgrammar
pulls triton and tvm-ffi, outlines-core has no Lark and weaker JSON-schema coverage), vLLM's default structured
output backend, JSON schema + regex + Lark in one matcher, built for untrusted grammars (bounded lexer/parser work
per token), and it reads Qwen3's added tokens (``<tool_call>``) as the single tokens the model emits. Per token of a
constrained sequence: llguidance's mask ~0.2 ms, unpacking it ~0.1 ms, applying it ~0.8 ms on this 2-core CPU
(Qwen3's 152k vocabulary), on the loop thread.

The request field (``structured`` in the internal protocol, filled by the API from ``response_format``,
``structured_outputs`` or ``tool_choice``) is an object with exactly one of ``json_schema`` (a schema object),
``regex`` (a string), ``choice`` (a list of strings) or ``lark`` (a grammar). Whatever the sampling options, every
token sampled comes from the mask, so an answer that ends with a stop token is a whole sentence of the grammar; the
stop token is allowed exactly when the grammar is complete (an answer cut by ``max_tokens`` is a prefix).

Thinking: with Qwen3's thinking on, the first token may also be ``<think>``; the thought that follows is free and
the grammar applies from the token after ``</think>`` (vLLM's rule with a reasoning parser).
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
KINDS = ("json_schema", "regex", "choice", "lark")
# json.dumps' layout, no free whitespace: a model cannot pad an answer with blanks until max_tokens (a schema's own
# ``x-guidance`` options still override it)
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class StructuredError(ValueError):
    """The ``structured`` field cannot be compiled (the message says why, prefixed with the field)."""


def grammar_of(value: Any) -> str:
    """The llguidance grammar of a request's ``structured`` value; ``StructuredError`` when it is not one."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in KINDS:
        raise StructuredError(f"structured: must be an object with exactly one of {', '.join(KINDS)}")
    kind, arg = next(iter(value.items()))
    if kind == "json_schema":
        if not isinstance(arg, dict):
            raise StructuredError("structured.json_schema: must be a JSON schema object")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(arg), defaults=JSON_LAYOUT)
    elif kind == "regex":
        if not isinstance(arg, str) or not arg:
            raise StructuredError("structured.regex: must be a non-empty string")
        grammar = llguidance.LLMatcher.grammar_from_regex(arg)
    elif kind == "choice":
        if not isinstance(arg, list) or not arg or not all(isinstance(c, str) and c for c in arg):
            raise StructuredError("structured.choice: must be a non-empty list of non-empty strings")
        grammar = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in arg)
    else:
        if not isinstance(arg, str) or not arg:
            raise StructuredError("structured.lark: must be a non-empty string")
        grammar = arg
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredError(f"structured.{kind}: {error.strip()[:500]}")
    return grammar


class Grammars:
    """The deployment's llguidance tokenizer (built once, on the first structured request: ~3 s for Qwen3's vocabulary)
    and the per-sequence constraints made with it."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_id: int) -> None:
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self._ll: Any = None
        self._lock = threading.Lock()

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf  # transformers: kept out of a serve process's start, as is llguidance.torch

                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_id)
            return self._ll

    def constraint(self, grammar: str, thinking: bool) -> Constraint:
        """A fresh constraint for one sequence (``thinking``: the answer may open with a free ``<think>`` block)."""
        ll = self.ll_tokenizer()
        think = None
        if thinking:
            ids = self.tokenizer.convert_tokens_to_ids([THINK_OPEN, THINK_CLOSE])
            think = (ids[0], ids[1]) if all(isinstance(i, int) and i >= 0 for i in ids) else None
        return Constraint(llguidance.LLMatcher(ll, grammar, log_level=0), ll.vocab_size, think)


class Constraint:
    """One sequence's grammar state: ``mask`` before each sample, ``advance`` with the token sampled."""

    def __init__(self, matcher: Any, vocab_size: int, think: tuple[int, int] | None) -> None:
        # imported on the first constrained sequence: its module-level torch.compile pulls torch._dynamo and
        # inductor, ~2 s of CPU that every serve process (and test) paid at start, structured requests or none
        import llguidance.torch

        self.matcher, self.think = matcher, think
        self.state = "first" if think else "grammar"  # first -> thinking -> grammar, or first -> grammar
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self._fill = llguidance.torch.fill_next_token_bitmask

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` (V,) with every token the grammar forbids at -inf (left alone while thinking)."""
        if self.state == "thinking":
            return scores
        self._fill(self.matcher, self._bitmask, 0)
        allowed = _unpack(self._bitmask[0], scores.shape[-1])
        if self.state == "first" and self.think is not None:
            allowed[self.think[0]] = True
        return scores.masked_fill(torch.from_numpy(~allowed).to(scores.device), float("-inf"))

    def advance(self, token: int) -> None:
        if self.state == "first" and self.think is not None and token == self.think[0]:
            self.state = "thinking"
            return
        if self.state == "thinking":
            if self.think is not None and token == self.think[1]:
                self.state = "grammar"
            return
        self.state = "grammar"
        self.matcher.consume_token(token)


def _unpack(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    """llguidance's packed int32 mask (bit ``i % 32`` of word ``i // 32``, little-endian) as (vocab,) booleans; ids
    past the mask are forbidden. numpy's unpackbits: ~0.1 ms for Qwen3's vocabulary, torch's bit ops ~50x that."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
    return np.pad(bits, (0, vocab - len(bits))) if len(bits) < vocab else bits
