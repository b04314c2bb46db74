"""LoRA adapters of a Megatron/MindSpeed checkpoint exported as a Hugging Face PEFT adapter directory.

Merging into the base weights happens per TP shard while reading (``MegatronCheckpoint._stored``), as MindSpeed
merges, ``W_k + alpha/r · B_k @ A_k``, with one of two roundings (``merge_lora_rounded``, ConvertSpec
``lora_merge_rounding``): ``fp32`` (default) adds in fp32 and rounds once to the base dtype; ``mindspeed`` is
MindSpeed's exact arithmetic (``mindspeed_llm/tasks/checkpoint/convert_mg2hf.py::_merge_lora``: the fp32 product is
cast to the base dtype first, then scaled and added in that dtype), which for bf16 weights differs from ``fp32`` by
one rounding step on a share of the merged weights; ``fp32`` is the more accurate. Exporting an adapter alone needs the full A and B of each fused Megatron
module cut into the HF modules PEFT knows: ``linear_qkv``'s B rows split into q/k/v (per-KV-group interleave undone)
and ``linear_fc1``'s into gate/up; the A matrix is shared by the pieces, so ``B_q @ A`` is exactly the q rows of
``B @ A``. Output: ``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight`` etc., which ``peft.PeftModel`` loads.

The other way (``peft_deltas``): a PEFT adapter directory trained elsewhere becomes native weight deltas
``scale · B @ A`` per HF module (scale = alpha/r, or alpha/sqrt(r) with rsLoRA), fused into ``linear_qkv`` /
``linear_fc1`` with the shared mapping (a module without an adapter contributes zeros), to be added to a base.
PEFT's q/k/v adapters each have their own A, so they cannot become one unmerged fused LoRA of the same rank.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.hf import expected_hf_shapes
from engine.checkpoint.layout import shard, split_rule
from engine.checkpoint.sources import WeightSource, expert_range
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput
from engine.model.hf_mapping import HF_MODULES, LAYER_MAP
from engine.model.lora import merge_lora_rounded

PEFT_PREFIX = "base_model.model.model.layers."
_HF_MODULES = HF_MODULES  # native module -> its HF modules, from the one key map


def peft_tensors(
    modules: list[str], get: Callable[[str], torch.Tensor], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT key, tensor) for every adapted native module path (``decoder.layers.{L}.<module>``)."""
    for path in modules:
        _, _, layer, rest = path.split(".", 3)
        if rest not in _HF_MODULES:
            raise BadInput(f"LoRA on {path} has no Hugging Face counterpart", field="save_lora_to_hf")
        a, b = get(path + ".lora_A.weight"), get(path + ".lora_B.weight")
        pieces = LAYER_MAP[rest + ".weight"].split(b, cfg)  # B's rows split like the weight's; A is shared
        for hf_module, piece in zip(_HF_MODULES[rest], pieces, strict=True):
            prefix = f"{PEFT_PREFIX}{layer}.{hf_module}"
            yield prefix + ".lora_A.weight", a.contiguous().clone()
            yield prefix + ".lora_B.weight", piece.contiguous().clone()


def save_peft_adapter(
    modules: list[str],
    get: Callable[[str], torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | os.PathLike[str],
    r: int,
    alpha: float,
    dtype: torch.dtype | None = None,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into ``out_dir``; returns the directory."""
    if not modules:
        raise BadInput("the checkpoint holds no LoRA adapters (lora_A/lora_B keys) to export", field="save_lora_to_hf")
    tensors = {k: (t.to(dtype) if dtype else t) for k, t in peft_tensors(modules, get, cfg)}
    targets = sorted({k[len(PEFT_PREFIX) :].split(".", 1)[1].rsplit(".lora_", 1)[0].split(".")[-1] for k in tensors})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".adapter_model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }
    tmp = out / ".adapter_config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out / "adapter_config.json")  # a symlink planted at the name is replaced, never written through
    return out


PEFT_CONFIG = "adapter_config.json"
_PEFT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight$")
_NATIVE_OF = {hf: native for native, hfs in _HF_MODULES.items() for hf in hfs}


def is_peft_adapter(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / PEFT_CONFIG).is_file()


def _peft_settings(path: Path, field: str, alpha: float | None) -> tuple[dict[str, Any], float]:
    """The adapter's config and its merge scale (``alpha`` overrides the config's); BadInput for what a plain merge
    cannot reproduce."""
    try:
        config = json.loads((path / PEFT_CONFIG).read_text())
    except ValueError as err:
        raise BadInput(f"{field}: {path / PEFT_CONFIG} is not JSON ({err})", field=field) from err
    refused = {
        "peft_type": config.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    bad = [f"{k}={config.get(k)!r}" for k, flag in refused.items() if flag]
    if bad:
        raise BadInput(
            f"{field}: {path / PEFT_CONFIG}: only plain LoRA adapters can be merged here ({', '.join(bad)})",
            field=field,
        )
    r = int(config["r"])
    alpha = float(config["lora_alpha"]) if alpha is None else alpha
    return {**config, "lora_alpha": alpha}, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


class PeftDeltas:
    """Native weight key -> fp32 delta of a PEFT adapter, computed when asked: one module's delta at a time (a
    delta is as large as its weight, so holding them all would cost a full-size copy of every adapted matrix)."""

    def __init__(
        self,
        modules: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]],
        shapes: dict[str, Any],
        scale: float,
        cfg: ModelConfig,
    ):
        self.modules, self.shapes, self.scale, self.cfg = modules, shapes, scale, cfg

    def keys(self) -> list[str]:
        return list(self.modules)

    def get(self, key: str) -> torch.Tensor | None:
        pieces = self.modules.get(key)
        if pieces is None:
            return None
        native = key.split(".", 3)[3].removesuffix(".weight")
        parts = [
            self.scale * (pieces[hf][1] @ pieces[hf][0]) if hf in pieces else torch.zeros(self.shapes[key][hf])
            for hf in _HF_MODULES[native]
        ]
        return LAYER_MAP[native + ".weight"].fuse(*parts, self.cfg)


def peft_deltas(
    path: str | os.PathLike[str], cfg: ModelConfig, alpha: float | None = None, field: str = "lora_load"
) -> tuple[dict[str, Any], PeftDeltas]:
    """(facts for the summary, the deltas) of the PEFT adapter directory ``path``, every tensor checked up front."""
    path = Path(path)
    config, scale = _peft_settings(path, field, alpha)
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise BadInput(
            f"{field}: {weights} is missing (adapter_model.bin is not read: save with safetensors)", field=field
        )
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights)).items():
        m = _PEFT_KEY.match(key)
        if not m or m[2] not in _NATIVE_OF:
            raise BadInput(
                f"{field}: {weights}: tensor {key} is not a LoRA adapter of a Qwen3 attention/MLP projection",
                field=field,
            )
        if int(m[1]) >= cfg.num_layers:
            raise BadInput(
                f"{field}: {weights}: tensor {key} is for layer {m[1]}; the model has {cfg.num_layers}", field=field
            )
        pairs.setdefault((int(m[1]), m[2]), {})[m[3]] = tensor.float()
    hf_shapes = expected_hf_shapes(cfg)
    modules: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for (layer, hf_module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise BadInput(f"{field}: {weights}: layer {layer} {hf_module} has lora_{''.join(ab)} only", field=field)
        a, b = ab["A"], ab["B"]
        want = hf_shapes[f"model.layers.{layer}.{hf_module}.weight"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != want:
            raise BadInput(
                f"{field}: {weights}: layer {layer} {hf_module} adapter is B {tuple(b.shape)} @ A "
                f"{tuple(a.shape)}; the model's weight is {want}",
                field=field,
            )
        key = f"decoder.layers.{layer}.{_NATIVE_OF[hf_module]}.weight"
        modules.setdefault(key, {})[hf_module] = (a, b)
        shapes[key] = {hf: hf_shapes[f"model.layers.{layer}.{hf}.weight"] for hf in _HF_MODULES[_NATIVE_OF[hf_module]]}
    targets = sorted({hf.rsplit(".", 1)[1] for _, hf in pairs})
    return (
        {
            "lora_format": "peft",
            "lora_r": int(config["r"]),
            "lora_alpha": float(config["lora_alpha"]),
            "lora_targets": targets,
            "lora_merged": True,
        },
        PeftDeltas(modules, shapes, scale, cfg),
    )


class LoraOverlay:
    """A base checkpoint (HF, or anything with ``get_native``) with a Megatron LoRA checkpoint merged on top.

    This is how the trainer's adapter-only saves meet their base (``args.lora_base``, often an HF directory):
    every adapted weight becomes W + alpha/r · B @ A, cut per target TP shard like MindSpeed's merge.
    """

    def __init__(
        self,
        base: WeightSource,
        lora_dir: str | os.PathLike[str],
        lora_alpha: float | None,
        lora_r: int | None,
        rounding: str = "fp32",
    ):
        from engine.checkpoint.megatron_read import RankFiles

        self.base, self.config, self.rounding = base, base.config, rounding
        self.lora = RankFiles(lora_dir)
        self.lora_alpha = lora_alpha if lora_alpha is not None else getattr(self.lora.args, "lora_alpha", None)
        self.lora_r = lora_r if lora_r is not None else getattr(self.lora.args, "lora_r", None)
        if self.lora_modules() and (self.lora_alpha is None or self.lora_r is None):
            raise BadInput(f"{lora_dir}: give lora_r and lora_alpha to merge its adapters", field="lora_r")

    def get_native(self, key: str) -> torch.Tensor:
        return self.get_native_shard(key, 1, 0)

    def get_native_shard(self, key: str, tp: int, rank: int) -> torch.Tensor:
        module = key.removesuffix(".weight")
        a_key, b_key = module + ".lora_A.weight", module + ".lora_B.weight"
        if self.lora.has(key):  # a full-model LoRA save overrides the base weights
            weight = shard(self.lora.full(key), split_rule(key), tp, rank)
        elif hasattr(self.base, "get_native_shard"):
            weight = self.base.get_native_shard(key, tp, rank)
        else:
            weight = shard(self.base.get_native(key), split_rule(key), tp, rank)
        if not (self.lora.has(a_key) and self.lora.has(b_key)):
            return weight
        a = shard(self.lora.full(a_key), split_rule(a_key), tp, rank)
        b = shard(self.lora.full(b_key), split_rule(b_key), tp, rank)
        assert self.lora_alpha is not None and self.lora_r is not None  # __init__ refuses adapters without them
        return merge_lora_rounded(weight, a, b, self.lora_alpha, self.lora_r, self.rounding)

    def get_experts(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Experts [lo, hi) of the stacked native ``key``, merged: the adapters are stacked per expert too."""
        module = key.removesuffix(".weight")
        a_key, b_key = module + ".lora_A.weight", module + ".lora_B.weight"
        if self.lora.has(key) or not (self.lora.has(a_key) and self.lora.has(b_key)):
            return self.get_native(key)[lo:hi] if self.lora.has(key) else expert_range(self.base, key, lo, hi)
        assert self.lora_alpha is not None and self.lora_r is not None  # __init__ refuses adapters without them
        a, b = self.lora.full(a_key)[lo:hi], self.lora.full(b_key)[lo:hi]
        weight = expert_range(self.base, key, lo, hi)
        return merge_lora_rounded(weight, a, b, self.lora_alpha, self.lora_r, self.rounding)

    def lora_modules(self) -> list[str]:
        return self.lora.lora_modules()

    def lora_tensor(self, key: str) -> torch.Tensor:
        return self.lora.full(key)


class PeftOverlay:
    """A base checkpoint with a Hugging Face PEFT adapter directory merged on top: W + delta in fp32 (``peft_deltas``),
    cast back to the base's dtype and cut per target TP shard (MindSpeed merges no PEFT adapters, so no rounding
    option here)."""

    lora_merged = True

    def __init__(
        self,
        base: WeightSource,
        adapter_dir: str | os.PathLike[str],
        lora_alpha: float | None,
        dtype: torch.dtype | None = None,
        field: str = "lora_load",
    ):
        self.base, self.config, self.dtype = base, base.config, dtype  # dtype: of merged tensors (default: base's)
        self.facts, self.deltas = peft_deltas(adapter_dir, base.config, alpha=lora_alpha, field=field)

    def get_native(self, key: str) -> torch.Tensor:
        return self.get_native_shard(key, 1, 0)

    def get_native_shard(self, key: str, tp: int, rank: int) -> torch.Tensor:
        if hasattr(self.base, "get_native_shard"):
            weight = self.base.get_native_shard(key, tp, rank)
        else:
            weight = shard(self.base.get_native(key), split_rule(key), tp, rank)
        delta = self.deltas.get(key)
        if delta is None:
            return weight
        return (weight.float() + shard(delta, split_rule(key), tp, rank)).to(self.dtype or weight.dtype)

    def lora_modules(self) -> list[str]:
        return []  # merged into the weights
