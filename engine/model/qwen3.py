"""Qwen3 dense and MoE decoder, math only, with Megatron-Core local-spec module names (MoE MLP: ``engine.model.moe``).

References: transformers ``models/qwen3/modeling_qwen3.py`` (the numerics we match: RMSNorm in fp32, rotate-half RoPE,
q/k RMSNorm per head before RoPE, SwiGLU), Megatron-Core ``transformer/attention.py`` + ``mlp.py`` (fused
``linear_qkv`` interleaved per KV group, ``linear_fc1`` = [gate; up]) and torchtitan ``models/qwen3/model/model.py``
(written for outside transforms). Written so that parallelism can be applied from outside:
- head counts are read from tensor shapes (views with -1): TP may shard ``linear_qkv`` by whole KV groups,
  ``linear_fc1`` as [gate_k; up_k], ``linear_proj``/``linear_fc2`` on their input dim;
- layers live in a ModuleDict keyed by the global layer index, so a pipeline stage can delete some and keep keys;
- ``forward`` accepts hidden states when ``embedding`` was removed and returns hidden states when the final norm was
  removed (``model.embedding = None``, ``model.decoder.final_layernorm = None``);
- ``init_weights`` is separate from ``__init__`` (build on the meta device, ``to_empty``, then initialise).
State-dict keys are the native keys of ``engine.model.hf_mapping``; the model holds no buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from engine.contract.model_config import ModelConfig
from engine.model.attention import AttentionPlan, core_attention, plan_attention
from engine.model.kv_cache import KVCache
from engine.model.lean_ops import apply_rope as _rotate
from engine.model.lean_ops import free_until_grad, recompute_activation, rms_norm, swiglu, take_rebuild
from engine.model.moe import MoELayer
from engine.model.rope import Rope, rope_cos_sin


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back before the weight (as transformers); saves
    the input and the fp32 reciprocal RMS only (``engine.model.lean_ops.RMSNormFunction``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x (B, n, T, d): rotate-half RoPE (the HF/Qwen convention: pairs (i, i + d/2), not adjacent)."""
    return _rotate(x, rope[0][:, None], rope[1][:, None])  # cos/sin (B, 1, T, d)


class SelfAttention(nn.Module):
    """GQA with per-head q/k RMSNorm; ``linear_qkv`` rows are [q heads of group g; k_g; v_g] for each group g."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.kv_channels
        self.heads_per_group = cfg.heads_per_group  # unchanged by TP, which shards whole groups
        self.linear_qkv = nn.Linear(cfg.hidden_size, cfg.qkv_rows, bias=False)
        self.q_layernorm = RMSNorm(cfg.kv_channels, cfg.norm_epsilon)
        self.k_layernorm = RMSNorm(cfg.kv_channels, cfg.norm_epsilon)
        self.linear_proj = nn.Linear(cfg.num_attention_heads * cfg.kv_channels, cfg.hidden_size, bias=False)
        # q, k, v (B, heads, T, d) -> (B, T, heads, d); context parallelism wraps it (engine.parallel.context_parallel)
        self.attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionPlan], torch.Tensor] = core_attention
        # An output that ``attend`` can rebuild (Ulysses' token-major copy of what attention saved) is freed from
        # linear_proj's forward until its backward; off under activation checkpointing, which does not keep it.
        self.free_attention_output = True

    def forward(
        self, x: torch.Tensor, rope: Rope, plan: AttentionPlan, kv_cache: KVCache | None = None, layer_idx: int = 0
    ) -> torch.Tensor:
        b, t, _ = x.shape
        d, hpg = self.head_dim, self.heads_per_group
        qkv = self.linear_qkv(x).view(b, t, -1, (hpg + 2) * d)  # (B, T, groups_local, (hpg+2)*d)
        q, k, v = qkv.split([hpg * d, d, d], dim=-1)
        # k and v copied out of qkv: what the k norm and attention save is then k and v alone, not all of qkv
        q = self.q_layernorm(q.reshape(b, t, -1, d)).transpose(1, 2)  # (B, heads_local, T, d)
        k = self.k_layernorm(k.contiguous()).transpose(1, 2)  # (B, groups_local, T, d)
        v = v.contiguous().transpose(1, 2)  # (B, groups_local, T, d)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)  # (B, groups_local, past+T, d)
        out = self.attend(q, k, v, plan)  # (B, T, heads_local, d)
        y = self.linear_proj(out.reshape(b, t, -1))
        if (values := take_rebuild(out)) is not None and self.free_attention_output:
            free_until_grad(out, y, values)
        return y


class MLP(nn.Module):
    """SwiGLU: fc2(silu(gate) * up) with ``linear_fc1`` = [gate; up] (per TP rank: [gate_k; up_k]). Of the MLP's
    own activations only fc1's output stays saved: the product fc2 reads is freed after fc2's forward and rebuilt
    before its backward (``free_activation``; off in layers under activation checkpointing, which free it anyway)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)
        self.free_activation = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)  # (B, T, 2 * ffn_local) = [gate; up]
        act = swiglu(h)
        out = self.linear_fc2(act)
        if self.free_activation:
            recompute_activation(h, act, out)
        return out


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); ``mlp`` is routed experts in MoE layers."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.self_attention = SelfAttention(cfg)
        self.pre_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.mlp: MLP | MoELayer = MoELayer(cfg) if cfg.is_moe_layer(index) else MLP(cfg)

    def forward(
        self, x: torch.Tensor, rope: Rope, plan: AttentionPlan, kv_cache: KVCache | None = None, layer_idx: int = 0
    ) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), rope, plan, kv_cache, layer_idx)
        if isinstance(self.mlp, MoELayer) and plan.counted is not None:
            return x + self.mlp(self.pre_mlp_layernorm(x), plan.counted, plan.counted_tokens)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: Iterable[int] | None = None, final_norm: bool = True) -> None:
        super().__init__()
        chosen = range(cfg.num_layers) if layers is None else layers
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, i) for i in chosen})
        self.final_layernorm: RMSNorm | None = RMSNorm(cfg.hidden_size, cfg.norm_epsilon) if final_norm else None


class Qwen3Model(nn.Module):
    """Qwen3 causal LM. ``forward`` returns logits (B, T, V), or final-norm hidden states with ``return_hidden``.

    ``layers`` / ``embedding`` / ``head`` build only a part (a pipeline stage: global layer keys kept); build under
    ``torch.device("meta")`` to allocate nothing, then ``to_empty`` + ``init_weights`` or a loader."""

    def __init__(
        self, cfg: ModelConfig, layers: Iterable[int] | None = None, embedding: bool = True, head: bool = True
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding: Embedding | None = Embedding(cfg) if embedding else None
        self.context_parallel = 1  # ranks a sequence is split over (engine.parallel.context_parallel)
        self.ring_attention = False  # a ring among them: attention is planned by sample runs, not by a mask
        self.context_group: ProcessGroup | None = None  # their group: per-sequence sums are completed over it
        self.decoder = Decoder(cfg, layers, final_norm=head)
        self.output_layer: nn.Linear | None = (
            None if cfg.tie_word_embeddings or not head else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def output_weight(self) -> torch.Tensor:
        """The (V, H) head matrix: ``output_layer`` if present, else the tied embedding."""
        if self.output_layer is not None:
            return self.output_layer.weight
        if self.embedding is not None and self.cfg.tie_word_embeddings:
            return self.embedding.word_embeddings.weight
        raise RuntimeError(
            "output_layer: this model part has neither an output layer nor the tied embedding; a pipeline last "
            "stage of a tied model must carry its own output_layer (as Megatron does)"
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_hidden: bool = False,
        counted: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Args:
        input_ids: (B, T) token ids, or (B, T, H) hidden states when ``embedding`` was removed.
        position_ids: (B, T); default arange after the cache length, or from ``attention_mask`` (left padding).
        segment_ids: (B, T) packed samples: each run of equal ids is one sample and attention stays causal within
            it (positions restart per sample, given by the caller; padding may be its own run).
        attention_mask: (B, past + T) 1 = real token, 0 = left padding (batched generation).
        kv_cache: appended to; ``kv_cache.length`` is the past length.
        return_hidden: return final-norm hidden states (B, T, H) instead of logits. Without a final norm (not
            the last pipeline stage) the layer output is returned.
        counted: (T,) bool for every row, or (B, T), the tokens MoE routing figures count (context parallelism's
            shard of rows it padded itself: ``engine.train.batches.context_shard``); None: all.
        """
        h = self.embedding(input_ids) if self.embedding is not None else input_ids  # (B, T, H)
        b, t = h.shape[:2]
        past = kv_cache.length if kv_cache is not None else 0
        if position_ids is None:
            position_ids = default_position_ids(b, t, past, attention_mask, h.device)
        rope = rope_cos_sin(position_ids, self.cfg, h.dtype)
        # under context parallelism h holds 1/CP of the tokens; attention sees them all (segment_ids are whole)
        plan = plan_attention(
            h.device,
            t * self.context_parallel,
            past,
            segment_ids,
            attention_mask,
            batch=b,
            runs_only=self.ring_attention,
        )
        if counted is not None:  # one host read per forward, not one per MoE layer
            rows = b if counted.dim() == 1 else 1
            plan.counted, plan.counted_tokens = counted.to(h.device), int(counted.sum()) * rows
        for idx, layer in self.decoder.layers.items():
            h = layer(h, rope, plan, kv_cache, int(idx))
        if self.decoder.final_layernorm is None:
            return h
        h = self.decoder.final_layernorm(h)
        if return_hidden:
            return h
        return F.linear(h, self.output_weight())  # (B, T, V)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Megatron init: every matrix ~ N(0, std) (the MoE router and stacked experts too); the two
        residual-output matrices (``linear_proj``, ``linear_fc2``, expert ``linear_fc2``) ~ N(0, std / sqrt(2 *
        num_layers)) (``scaled_init_method_normal``); norms = 1."""
        generators: dict[torch.device, torch.Generator] = {}
        for name, param in self.named_parameters():
            if ".lora_" in name:
                continue  # adapters have their own init (B = 0 keeps the converted model equal to the base)
            std = init_std(name, param.dim(), self.cfg)
            if std is None:
                nn.init.ones_(param)
                continue
            gen = generators.get(param.device)
            if gen is None and seed is not None:
                gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            nn.init.normal_(param, 0.0, std, generator=gen)
        for module in self.modules():
            reset = getattr(module, "reset_lora_parameters", None)
            if callable(reset):
                reset()


def init_std(name: str, ndim: int, cfg: ModelConfig) -> float | None:
    """The std of parameter ``name``'s normal init (Megatron's rule, see ``init_weights``); None for a norm (ones).
    ``engine.checkpoint.sources.SeededInit`` draws the same numbers for a rank's shard of a meta-built model."""
    if ndim == 1:
        return None
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    return cfg.init_method_std


def default_position_ids(
    batch: int, length: int, past: int, attention_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """arange(past, past + T) per row; with left padding, positions count real tokens only (as HF generate)."""
    if attention_mask is None:
        return torch.arange(past, past + length, device=device).expand(batch, length)
    pos = attention_mask.long().cumsum(-1) - 1  # (B, past + T)
    return pos.clamp(min=0)[:, -length:]
