"""``DecoderLM``: what the engine's callers use of a decoder-only language model, whichever family built it.

Training, evaluation, serving and the parallel transforms hold a model as an ``nn.Module`` (FSDP, TP and the
pipeline split keep the class but wrap it); where they need the language model's own parts they narrow it with
``decoder_lm(model)``, which checks those parts are there instead of asserting a class (``cast`` checked nothing).
``Qwen3Model`` (both families of ``engine.model.families``) implements it; a new family's model must too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from engine.contract.model_config import ModelConfig
    from engine.model.kv_cache import KVCache
    from engine.model.qwen3 import Decoder, Embedding


@runtime_checkable
class DecoderLM(Protocol):
    """A causal LM (or a pipeline stage of one): embedding -> decoder layers -> final norm -> head."""

    cfg: ModelConfig  # the model's shape
    embedding: Embedding | None  # None on a pipeline stage after the first
    decoder: Decoder  # ``layers`` keyed by global layer index, ``final_layernorm`` (None before the last stage)
    output_layer: nn.Linear | None  # None when tied to the embedding, or before the last stage
    context_parallel: int  # ranks a sequence is split over (``engine.parallel.context_parallel`` sets the three)
    ring_attention: bool
    context_group: ProcessGroup | None

    def output_weight(self) -> torch.Tensor:
        """The (V, H) head matrix (a vocab-sharded DTensor under TP)."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_hidden: bool = False,
        counted: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V), or hidden states with ``return_hidden`` (see ``Qwen3Model.forward``)."""
        ...


# checked by hand: ``isinstance`` against a runtime-checkable protocol recomputes its members each call (62 us
# against 10 us here, Python 3.11 at load 13.6 on 2 cores), and decoding narrows once per step
_MEMBERS = (*DecoderLM.__annotations__, "output_weight")


def _is_decoder_lm(model: nn.Module) -> TypeGuard[DecoderLM]:
    return all(hasattr(model, name) for name in _MEMBERS)


def decoder_lm(model: nn.Module) -> DecoderLM:
    """``model`` seen as a ``DecoderLM``; TypeError naming what it lacks (a module that is no language model)."""
    if _is_decoder_lm(model):
        return model
    missing = ", ".join(name for name in _MEMBERS if not hasattr(model, name))
    raise TypeError(f"{type(model).__name__} is not a DecoderLM (no {missing})")
