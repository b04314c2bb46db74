"""LoRA as a converter applied to a built model from outside (torchtitan ``components/lora.py``, litgpt ``lora.py``).

``apply_lora`` swaps the target ``nn.Linear`` modules for ``LoRALinear`` (an ``nn.Linear`` subclass that keeps the
same ``weight`` Parameter, so base keys stay the native keys) with two adapters: y = W x + (alpha/r) · B(A(drop(x))).
A ~ kaiming-uniform (as PEFT), B = 0, so the converted model starts equal to the base. Everything that is not an
adapter is frozen, optionally cast to bf16 (adapters stay fp32).

Targets: Megatron names ``linear_qkv linear_proj linear_fc1 linear_fc2`` or HF names. HF names map onto our fused
modules: q_proj,k_proj,v_proj -> linear_qkv; o_proj -> linear_proj; gate_proj,up_proj -> linear_fc1;
down_proj -> linear_fc2. A fused module gets ONE adapter pair, so a partial HF target (only q_proj, or q_proj+v_proj)
is refused: one adapter on the fused rows is not what PEFT would train on the HF model (q+v in PEFT = two independent
rank-r adapters; a row-masked fused adapter would share A), and silently training something else would be dishonest.
Empty targets = all four modules (MindSpeed's qwen3 LoRA scripts pass all four).

Key names. Ours (native module path): ``decoder.layers.{i}.self_attention.linear_qkv.lora_A.weight`` (r, in) and
``...lora_B.weight`` (out, r); the base stays ``...linear_qkv.weight``. MindSpeed-LLM (PEFT wrapped, unwrapped
prefix) names the same tensors ``...linear_qkv.lora_A.default.weight`` / ``lora_B.default.weight`` and the base
``...linear_qkv.base_layer.weight`` (docs/megatron-interop.md §3); ``to_mindspeed_keys``/``from_mindspeed_keys`` rename.
Scale alpha/r, as MindSpeed (no rsLoRA).

Tensor parallelism (to be applied by engine.parallel, as MindSpeed ``lora_moe.py`` does):
- column-parallel targets (linear_qkv, linear_fc1): A replicated on every TP rank, weight (r, H); B sharded like the
  base weight along dim 0, (out/TP, r), its rows in the same per-rank layout as the base shard (whole KV groups of
  interleaved q,k,v; [gate_k; up_k]). Local result: W_k x + s·B_k(A x), no extra communication.
- row-parallel targets (linear_proj, linear_fc2): A sharded along its input dim, (r, in/TP); B replicated, (out, r).
  The rank-r partial sums A_k x_k must be all-reduced before B (or B applied locally and the sum folded into the
  base output's all-reduce, since B is linear).
Merging per shard is then exact: W_k + s·B_k A (column) and W_k + s·B A_k (row).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.contract.lora_targets import resolve_targets
from engine.model.moe import StackedWeight, expert_matmul, local_weight


def reset_lora_pair(a: torch.Tensor, b: torch.Tensor, fan_in: int, generator: torch.Generator | None = None) -> None:
    """A as ``nn.Linear``'s default (kaiming-uniform, a=sqrt(5)), as PEFT; B = 0: the adapter starts as a no-op."""
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        a.uniform_(-bound, bound, generator=generator)
        b.zero_()


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update; ``weight`` (and ``bias``) are the base layer's own Parameters."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # shared, not copied: base keys and optimizer refs hold
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.adapters_off = False  # set by ``adapters_disabled``
        kw = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Linear(base.in_features, r, bias=False, **kw)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora_parameters()

    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        reset_lora_pair(self.lora_A.weight, self.lora_B.weight, self.in_features, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        if self.adapters_off:
            return base
        low = _AdapterIn.apply(self.lora_dropout(x), self.lora_A.weight)
        return base + (self.lora_B(low) * self.scaling).to(base.dtype)


class _AdapterIn(torch.autograd.Function):
    """A(x) computed in A's dtype (fp32) but saving x in its own (the compute dtype, bf16): an fp32 copy of every
    adapted module's input would be saved otherwise, twice the bytes of the input itself."""

    # ctx: Any (forward, backward): autograd's context, carrying what forward saves for backward (torch types it so)
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, a)
        return F.linear(x.to(a.dtype), a)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, a = ctx.saved_tensors
        dx = (dy @ a).to(x.dtype) if ctx.needs_input_grad[0] else None
        da = None
        if ctx.needs_input_grad[1]:
            da = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(a.dtype)
        return dx, da


class LoRAStacked(nn.Module):
    """Stacked expert weights (``engine.model.moe.StackedWeight``, (E, out, in)) plus one low-rank update per
    expert, as PEFT puts one adapter on each expert's Linear: lora_A (E, r, in), lora_B (E, out, r)."""

    def __init__(self, base: StackedWeight, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.weight = base.weight  # shared: base keys and optimizer refs hold
        e, out, inn = base.weight.shape
        self.in_features, self.r, self.alpha, self.scaling = inn, r, alpha, alpha / r
        self.adapters_off = False  # set by ``adapters_disabled``
        self.lora_A = StackedWeight(e, r, inn).to(device=base.weight.device, dtype=torch.float32)
        self.lora_B = StackedWeight(e, out, r).to(device=base.weight.device, dtype=torch.float32)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora_parameters()

    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        reset_lora_pair(self.lora_A.weight, self.lora_B.weight, self.in_features, generator)  # every expert at once

    def project(self, x: torch.Tensor, counts: torch.Tensor, backend: str) -> torch.Tensor:
        base = expert_matmul(x, local_weight(self.weight), counts, backend)
        if self.adapters_off:
            return base
        a, b = local_weight(self.lora_A.weight), local_weight(self.lora_B.weight)
        a_in = self.lora_dropout(x).to(a.dtype)
        low = expert_matmul(expert_matmul(a_in, a, counts, backend), b, counts, backend)
        return base + (low * self.scaling).to(base.dtype)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base: every adapter skipped (no second copy of the weights; preference training's
    reference for LoRA runs, as PEFT's ``disable_adapter``)."""
    layers = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAStacked))]
    for layer in layers:
        layer.adapters_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.adapters_off = False


def apply_lora(
    model: nn.Module,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    targets: Iterable[str] = (),
    base_dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> list[str]:
    """Wrap every target Linear of ``model`` in place, freeze the rest; returns the wrapped module paths."""
    if r < 1:
        raise ValueError(f"lora_r: must be at least 1, got {r}")
    wanted = set(resolve_targets(targets))
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    wrapped = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in wanted and type(module) in (nn.Linear, StackedWeight):
            lora: LoRALinear | LoRAStacked = (
                LoRALinear(module, r, alpha, dropout)
                if type(module) is nn.Linear
                else LoRAStacked(module, r, alpha, dropout)
            )
            if gen is not None and module.weight.device.type == "cpu":
                lora.reset_lora_parameters(gen)
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, leaf, lora)
            wrapped.append(name)
    if not wrapped:
        raise ValueError(f"lora_target_modules: no module named {sorted(wanted)} in the model")
    for pname, param in model.named_parameters():
        is_adapter = ".lora_A." in pname or ".lora_B." in pname
        param.requires_grad_(is_adapter)
        if base_dtype is not None and not is_adapter:
            param.data = param.data.to(base_dtype)
    return wrapped


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors only: ``<module>.lora_A.weight`` and ``<module>.lora_B.weight`` under native paths."""
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load adapters saved by ``lora_state_dict`` (MindSpeed names accepted); refuses missing or extra keys."""
    state = from_mindspeed_keys(state)
    own = lora_state_dict(model)
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"lora_load: adapter keys do not match the model (missing {missing[:3]}, extra {extra[:3]})")
    model.load_state_dict(state, strict=False)


def merge_lora(
    base_weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    alpha: float,
    r: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W + (alpha/r) · B @ A computed in fp32, returned in ``out_dtype`` (default the base dtype): one rounding.

    MindSpeed rounds the product to the base dtype before adding (``merge_lora_rounded`` "mindspeed")."""
    merged = base_weight.float() + (alpha / r) * (lora_b.float() @ lora_a.float())
    return merged.to(out_dtype or base_weight.dtype)


MERGE_ROUNDINGS = ("fp32", "mindspeed")


def merge_lora_rounded(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float, r: int, rounding: str = "fp32"
) -> torch.Tensor:
    """``weight + alpha/r · b @ a`` in the base dtype with ``rounding``: "fp32" (``merge_lora``, one rounding) or
    MindSpeed's "mindspeed" (see ``engine.checkpoint.lora_merge``'s module docstring)."""
    if rounding == "mindspeed":  # base + (alpha / r) * matmul(B.float(), A.float()).to(base.dtype), literally
        return weight + (alpha / r) * torch.matmul(b.float(), a.float()).to(weight.dtype)
    if rounding != "fp32":
        raise ValueError(f"lora_merge_rounding: {rounding!r} is not one of {', '.join(MERGE_ROUNDINGS)}")
    return merge_lora(weight, a, b, alpha, r)


@torch.no_grad()
def merge_into(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weight and put plain ``nn.Linear`` modules back; returns their paths."""
    merged = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        w = merge_lora(module.weight, module.lora_A.weight, module.lora_B.weight, module.alpha, module.r)
        plain.weight = nn.Parameter(w, requires_grad=module.weight.requires_grad)
        plain.bias = module.bias
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, plain)
        merged.append(name)
    return merged


def to_mindspeed_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our adapter (and base) keys -> MindSpeed-LLM's PEFT names (``lora_A.default``, ``base_layer``)."""
    adapted = {k.rsplit(".lora_A.", 1)[0] for k in state if ".lora_A." in k}
    out = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        if module.endswith((".lora_A", ".lora_B")):
            out[f"{module}.default.{leaf}"] = value
        elif module in adapted:
            out[f"{module}.base_layer.{leaf}"] = value
        else:
            out[key] = value
    return out


def from_mindspeed_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``to_mindspeed_keys``; also accepts lower-case ``lora_a``/``lora_b``; drops ``_extra_state``."""
    out = {}
    for key, value in state.items():
        if key.endswith("._extra_state"):
            continue
        key = key.replace(".lora_a.", ".lora_A.").replace(".lora_b.", ".lora_B.")
        key = key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        out[key.replace(".base_layer.", ".")] = value
    return out
