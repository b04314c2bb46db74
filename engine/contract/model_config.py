"""Model shape: built from an HF ``config.json``, a named preset, or a spec's Megatron flags.

MoE (Qwen3-MoE) fields use Megatron's names and meanings: ``num_experts``, ``moe_router_topk``,
``moe_ffn_hidden_size``, ``moe_layer_freq`` (an int k: layers with ``i % k == 0`` are MoE; or one 0/1 per layer),
``moe_aux_loss_coeff``, ``moe_expert_capacity_factor``. HF's ``decoder_sparse_step`` / ``mlp_only_layers`` (layer i is
MoE when ``(i + 1) % step == 0`` and i is not listed) are turned into the explicit per-layer pattern by ``from_hf``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol

from engine.contract import rope_scaling
from engine.contract.constants import QWEN3_ENDOFTEXT_ID, QWEN3_IM_END_ID
from engine.contract.families import Family, family_for, family_of_hf

QWEN3_VOCAB = 151936


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Qwen3 dense shape. Names follow Megatron flags; ``to_hf``/``from_hf`` map to ``Qwen3Config``."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int  # head dim; Qwen3 sets it explicitly (128), not hidden / heads
    vocab_size: int = QWEN3_VOCAB  # padded vocab: rows of the embedding and output matrices
    norm_epsilon: float = 1e-6
    rotary_base: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    # MoE (None / 0 experts: a dense model). Routing: softmax over experts, top-k, renormalised when norm_topk_prob.
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # per-expert FFN width; default ffn_hidden_size
    moe_layer_freq: int | tuple[int, ...] = 1
    norm_topk_prob: bool = False
    moe_aux_loss_coeff: float = 0.0  # Megatron's per-layer switch load-balancing loss weight (HF router_aux_loss_coef)
    moe_expert_capacity_factor: float | None = None  # None: dropless; else Megatron token dropping (policy "probs")
    # RoPE scaling (engine.contract.rope_scaling; MindSpeed's flag names). None: plain RoPE.
    rope_scaling_type: str | None = None
    rope_scaling_factor: float = 1.0
    rope_scaling_original_max_position_embeddings: int | None = None
    rope_scaling_beta_fast: float = 32.0
    rope_scaling_beta_slow: float = 1.0
    rope_scaling_mscale: float | None = None
    rope_scaling_mscale_all_dim: float | None = None
    rope_scaling_attention_factor: float | None = None
    # The architecture (engine.contract.families): with num_experts it names the family the runtime builds.
    model_family: str = "qwen3"

    def __post_init__(self) -> None:
        family_for(self.model_family, self.is_moe)  # UnknownFamily (a ValueError) naming model_family
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if isinstance(self.moe_layer_freq, list):  # JSON round trip (checkpoint metadata) gives a list
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        rope_scaling.check(self)
        if not self.is_moe:
            return
        if not 1 <= self.moe_router_topk <= self.num_experts:  # type: ignore[operator]
            raise ValueError(f"moe_router_topk ({self.moe_router_topk}) must be in 1..num_experts ({self.num_experts})")
        freq = self.moe_layer_freq
        if isinstance(freq, tuple) and len(freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq: the pattern has {len(freq)} entries but num_layers is {self.num_layers}")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"moe_layer_freq: must be >= 1, got {freq}")
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor <= 0:
            raise ValueError(f"moe_expert_capacity_factor: must be positive, got {self.moe_expert_capacity_factor}")

    @property
    def family(self) -> Family:
        return family_for(self.model_family, self.is_moe)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based, global) has routed experts instead of the dense MLP."""
        if not self.is_moe:
            return False
        freq = self.moe_layer_freq
        return bool(freq[index]) if isinstance(freq, tuple) else index % freq == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def max_positions(self) -> int:
        """The longest position this model reaches (``max_position_embeddings``, stretched by YaRN)."""
        return rope_scaling.max_positions(self)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused ``linear_qkv`` weight: per group, its q heads then one k and one v head."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """All parameters, or with ``active`` those one token uses (top-k of the experts, as FLOPs count them)."""
        h, d = self.hidden_size, self.kv_channels
        attn = h * self.qkv_rows + self.num_attention_heads * d * h + 2 * d
        matrices = self.family.mlp_matrices
        dense_mlp = matrices * h * self.ffn_hidden_size
        experts = self.moe_router_topk if active else (self.num_experts or 0)
        moe_mlp = (self.num_experts or 0) * h + experts * matrices * h * self.expert_ffn_hidden_size  # router, experts
        n_moe = len(self.moe_layers)
        layers = self.num_layers * (attn + 2 * h) + n_moe * moe_mlp + (self.num_layers - n_moe) * dense_mlp
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + h + (emb if include_embedding else 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """The shape of an HF ``config.json`` of a supported family (``UnknownFamily`` names any other)."""
        fam = family_of_hf(hf)
        heads = hf["num_attention_heads"]
        return cls(
            model_family=fam.base,
            num_layers=hf["num_hidden_layers"],
            hidden_size=hf["hidden_size"],
            ffn_hidden_size=hf["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,
            kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            rotary_base=float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 1e6)),
            max_position_embeddings=hf.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_method_std=hf.get("initializer_range", 0.02),
            **moe_from_hf(hf),
            **rope_scaling.from_hf(hf),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file}: no config.json in the HF model directory")
        return cls.from_hf(json.loads(config_file.read_text()))

    def to_hf(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A ``config.json`` that ``transformers.Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM`` for MoE) loads."""
        out = {
            "architectures": [self.family.hf_architecture],
            "model_type": self.family.hf_model_type,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": QWEN3_ENDOFTEXT_ID,
            "eos_token_id": QWEN3_IM_END_ID,
            "head_dim": self.kv_channels,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.init_method_std,
            "intermediate_size": self.ffn_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_query_groups,
            "rms_norm_eps": self.norm_epsilon,
            "rope_scaling": rope_scaling.to_hf(self),
            "rope_theta": self.rotary_base,
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }
        if self.is_moe:
            out.update(self._moe_to_hf())
        return out

    def _moe_to_hf(self) -> dict[str, Any]:
        return {
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(self.num_layers) if not self.is_moe_layer(i)],
            "moe_intermediate_size": self.expert_ffn_hidden_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.moe_router_topk,
            "norm_topk_prob": self.norm_topk_prob,
            "output_router_logits": False,
            "router_aux_loss_coef": self.moe_aux_loss_coeff,
        }

    def replace(self, **changes: Any) -> ModelConfig:  # Any: each field has its own type (mypy checks them)
        return dataclasses.replace(self, **changes)


def hf_num_experts(hf: dict[str, Any]) -> int | None:
    """The routed-expert count of an HF ``config.json`` (None for a dense model)."""
    experts = hf.get("num_experts") or hf.get("num_local_experts")  # transformers 5 writes num_local_experts
    return experts if isinstance(experts, int) and experts > 0 else None


def moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig MoE fields from a Qwen3-MoE ``config.json`` (empty for a dense one)."""
    experts = hf_num_experts(hf)
    if not experts:
        return {}
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    return {
        "num_experts": experts,
        "moe_router_topk": hf.get("num_experts_per_tok", 8),
        "moe_ffn_hidden_size": hf.get("moe_intermediate_size"),
        "moe_layer_freq": 1 if all(pattern) else pattern,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.001)),
    }


def moe_from_args(args: object, num_layers: int) -> dict[str, Any]:
    """ModelConfig MoE fields from a Megatron checkpoint's ``args`` (ours carry the HF MoE attributes,
    ``engine.checkpoint.megatron_write.build_args``; Megatron's own ``num_experts``/``moe_router_topk``/
    ``moe_ffn_hidden_size``/``moe_aux_loss_coeff`` are read too); {} for a dense model or no args."""
    a = dict(getattr(args, "__dict__", None) or {})
    if not (a.get("num_experts") or a.get("num_local_experts")):
        return {}
    hf = {"num_hidden_layers": num_layers, **a}
    for hf_name, megatron_name in (
        ("num_experts_per_tok", "moe_router_topk"),
        ("moe_intermediate_size", "moe_ffn_hidden_size"),
        ("router_aux_loss_coef", "moe_aux_loss_coeff"),
    ):
        if hf.get(hf_name) is None and a.get(megatron_name) is not None:
            hf[hf_name] = a[megatron_name]
    return moe_from_hf(hf)


class MoeFlags(Protocol):
    """A spec's MoE flags (``engine.contract.spec.ModelArgs`` has them): named here, not imported, because the spec
    package imports this module (through ``engine.contract.layout``)."""

    @property
    def num_experts(self) -> int | None: ...
    @property
    def moe_router_topk(self) -> int: ...
    @property
    def moe_ffn_hidden_size(self) -> int | None: ...
    @property
    def moe_intermediate_size(self) -> int | None: ...
    @property
    def moe_layer_freq(self) -> int | list[int]: ...
    @property
    def norm_topk_prob(self) -> bool: ...
    @property
    def moe_aux_loss_coeff(self) -> float | None: ...
    @property
    def moe_router_load_balancing_type(self) -> str: ...
    @property
    def moe_expert_capacity_factor(self) -> float | None: ...


def moe_fields_from_flags(spec: MoeFlags, base: ModelConfig | None = None) -> dict[str, Any]:
    """ModelConfig MoE fields from a spec's Megatron/MindSpeed flags (``engine.contract.spec.ModelArgs``), to pass to
    ``ModelConfig(...)`` (a from-scratch model) or ``cfg.replace(...)`` (a loaded one, ``base``: only the training
    knobs then; the expert shape comes from the checkpoint). Empty for a dense model."""
    num_experts = spec.num_experts or (base.num_experts if base is not None else None)
    if not num_experts:
        return {}
    coeff = spec.moe_aux_loss_coeff
    if coeff is None:
        coeff = base.moe_aux_loss_coeff if base is not None else 0.0
    fields: dict[str, Any] = {
        "moe_aux_loss_coeff": 0.0 if spec.moe_router_load_balancing_type == "none" else coeff,
        "moe_expert_capacity_factor": spec.moe_expert_capacity_factor,
    }
    if base is None:
        freq = spec.moe_layer_freq
        fields.update(
            num_experts=num_experts,
            moe_router_topk=spec.moe_router_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.moe_intermediate_size,
            moe_layer_freq=tuple(freq) if isinstance(freq, list) else freq,
            norm_topk_prob=spec.norm_topk_prob,
        )
    return fields


def _preset(
    layers: int, hidden: int, ffn: int, heads: int, groups: int, tied: bool, **kw: Any
) -> ModelConfig:  # Any: ModelConfig's fields
    return ModelConfig(layers, hidden, ffn, heads, groups, kw.pop("kv_channels", 128), tie_word_embeddings=tied, **kw)


_MOE: dict[str, Any] = {"num_experts": 128, "moe_router_topk": 8, "norm_topk_prob": True, "moe_aux_loss_coeff": 0.001}

# Shapes of the published Qwen3 dense checkpoints (their config.json files).
PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": _preset(28, 1024, 3072, 16, 8, True),
    "qwen3-1.7b": _preset(28, 2048, 6144, 16, 8, True),
    "qwen3-4b": _preset(36, 2560, 9728, 32, 8, True),
    "qwen3-8b": _preset(36, 4096, 12288, 32, 8, False),
    "qwen3-14b": _preset(40, 5120, 17408, 40, 8, False),
    "qwen3-32b": _preset(64, 5120, 25600, 64, 8, False),
    # MoE: Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json (128 experts, top-8, norm_topk_prob true,
    # router_aux_loss_coef 0.001, every layer sparse; intermediate_size is the dense width, unused by these shapes).
    "qwen3-30b-a3b": _preset(48, 2048, 6144, 32, 4, False, **_MOE, moe_ffn_hidden_size=768),
    "qwen3-235b-a22b": _preset(94, 4096, 12288, 64, 4, False, **_MOE, moe_ffn_hidden_size=1536),
    # For tests: the real vocabulary (so the real tokenizer works), everything else tiny.
    "qwen3-tiny": _preset(2, 64, 128, 4, 2, False, kv_channels=16, max_position_embeddings=2048),
    "qwen3-tiny-tied": _preset(2, 64, 128, 4, 2, True, kv_channels=16, max_position_embeddings=2048),
    # MoE for tests: 8 experts, top-2, layer 1 of 3 dense (mlp_only_layers=[1]).
    "qwen3-moe-tiny": _preset(
        3,
        64,
        128,
        4,
        2,
        False,
        kv_channels=16,
        max_position_embeddings=2048,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_layer_freq=(1, 0, 1),
        norm_topk_prob=True,
        moe_aux_loss_coeff=0.001,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None
