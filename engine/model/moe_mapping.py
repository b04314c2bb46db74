"""HF Qwen3-MoE <-> native names and layouts of the MoE tensors, one layer at a time.

Kept apart from ``engine.model.hf_mapping`` (being rewritten as one declarative table) so that the rules below can be
folded into that table at merge:

    decoder.layers.{i}.mlp.router.weight              (E, H)       <- model.layers.{i}.mlp.gate.weight
    decoder.layers.{i}.mlp.experts.linear_fc1.weight  (E, 2F, H)   <- stack_e [experts.{e}.gate_proj; .up_proj]
    decoder.layers.{i}.mlp.experts.linear_fc2.weight  (E, H, F)    <- stack_e experts.{e}.down_proj

Names are the published checkpoints' (``transformers`` keeps them on disk although its in-memory module holds
fused ``experts.gate_up_proj`` / ``experts.down_proj``). Dense layers of an MoE model (``mlp_only_layers``) keep the
dense rules. ``native_from_hf`` / ``hf_from_native`` here wrap ``hf_mapping``'s functions for whole MoE models until
the merge.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.model import hf_mapping
from engine.model.config import ModelConfig
from engine.model.hf_mapping import Getter, fuse_fc1, split_fc1

ROUTER = ("mlp.router.weight", "mlp.gate.weight")  # (native suffix, HF suffix)
EXPERT_FC1 = "mlp.experts.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.linear_fc2.weight"
_DENSE_MLP_NATIVE = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
_DENSE_MLP_HF = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def hf_expert_keys(layer: int, expert: int) -> tuple[str, str, str]:
    """HF (gate_proj, up_proj, down_proj) weight names of one expert."""
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def moe_native_keys(layer: int) -> list[str]:
    p = f"decoder.layers.{layer}."
    return [p + ROUTER[0], p + EXPERT_FC1, p + EXPERT_FC2]


def moe_layer_from_hf(get: Getter, cfg: ModelConfig, layer: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(native key, tensor) of one MoE layer's router and stacked experts."""
    n = f"decoder.layers.{layer}."
    yield n + ROUTER[0], get(f"model.layers.{layer}." + ROUTER[1])
    keys = [hf_expert_keys(layer, e) for e in range(cfg.num_experts or 0)]
    yield n + EXPERT_FC1, torch.stack([fuse_fc1(get(g), get(u)) for g, u, _ in keys])
    yield n + EXPERT_FC2, torch.stack([get(d) for _, _, d in keys])


def moe_layer_to_hf(get: Getter, cfg: ModelConfig, layer: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, tensor) of one MoE layer, reading the native stacked tensors through ``get``."""
    n = f"decoder.layers.{layer}."
    yield f"model.layers.{layer}." + ROUTER[1], get(n + ROUTER[0])
    fc1, fc2 = get(n + EXPERT_FC1), get(n + EXPERT_FC2)
    for e in range(fc1.shape[0]):
        gate_key, up_key, down_key = hf_expert_keys(layer, e)
        gate, up = split_fc1(fc1[e])
        yield gate_key, gate
        yield up_key, up
        yield down_key, fc2[e]


def _skip_dense_mlp(get: Getter, cfg: ModelConfig, prefix: str, names: tuple[str, ...]) -> Getter:
    """A getter that answers the dense-MLP names of MoE layers with empty placeholders (dropped by the caller)."""

    def wrapped(name: str) -> torch.Tensor:
        if name.startswith(prefix) and name.endswith(names):
            layer = int(name[len(prefix):].split(".", 1)[0])
            if cfg.is_moe_layer(layer):
                return torch.empty(2, 0)
        return get(name)

    return wrapped


def _is_dense_mlp_of_moe_layer(key: str, cfg: ModelConfig, prefix: str, names: tuple[str, ...]) -> bool:
    return key.startswith(prefix) and key.endswith(names) and cfg.is_moe_layer(int(key[len(prefix):].split(".", 1)[0]))


def native_from_hf(get: Getter, cfg: ModelConfig, layers: Iterable[int] | None = None,
                   embedding: bool = True, head: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``hf_mapping.native_from_hf`` for dense or MoE models (same arguments)."""
    wrapped = _skip_dense_mlp(get, cfg, "model.layers.", _DENSE_MLP_HF)
    yield from hf_mapping.native_from_hf(get, cfg, [], embedding=embedding, head=False)
    for i in range(cfg.num_layers) if layers is None else layers:
        for key, tensor in hf_mapping.native_from_hf(wrapped, cfg, [i], embedding=False, head=False):
            if not _is_dense_mlp_of_moe_layer(key, cfg, "decoder.layers.", _DENSE_MLP_NATIVE):
                yield key, tensor
        if cfg.is_moe_layer(i):
            yield from moe_layer_from_hf(get, cfg, i)
    yield from hf_mapping.native_from_hf(get, cfg, [], embedding=False, head=head)


def hf_from_native(get: Getter, cfg: ModelConfig, layers: Iterable[int] | None = None,
                   embedding: bool = True, head: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``hf_mapping.hf_from_native`` for dense or MoE models (same arguments)."""
    wrapped = _skip_dense_mlp(get, cfg, "decoder.layers.", _DENSE_MLP_NATIVE)
    yield from hf_mapping.hf_from_native(get, cfg, [], embedding=embedding, head=False)
    for i in range(cfg.num_layers) if layers is None else layers:
        for key, tensor in hf_mapping.hf_from_native(wrapped, cfg, [i], embedding=False, head=False):
            if not _is_dense_mlp_of_moe_layer(key, cfg, "model.layers.", _DENSE_MLP_HF):
                yield key, tensor
        if cfg.is_moe_layer(i):
            yield from moe_layer_to_hf(get, cfg, i)
    yield from hf_mapping.hf_from_native(get, cfg, [], embedding=False, head=head)
