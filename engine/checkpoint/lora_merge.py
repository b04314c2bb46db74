"""LoRA adapters of a Megatron/MindSpeed checkpoint exported as a Hugging Face PEFT adapter directory.

Merging into the base weights happens per TP shard while reading (``MegatronCheckpoint._stored``, MindSpeed's
``W_k + alpha/r · B_k @ A_k`` in fp32). Exporting an adapter alone needs the full A and B of each fused Megatron
module cut into the HF modules PEFT knows: ``linear_qkv``'s B rows split into q/k/v (per-KV-group interleave undone)
and ``linear_fc1``'s into gate/up; the A matrix is shared by the pieces, so ``B_q @ A`` is exactly the q rows of
``B @ A``. Output: ``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight`` etc., which ``peft.PeftModel`` loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors.torch import save_file

from engine.checkpoint.layout import shard, split_rule
from engine.model.config import ModelConfig
from engine.model.hf_mapping import split_fc1, split_qkv
from engine.model.lora import merge_lora
from engine.runfiles import BadInput

PEFT_PREFIX = "base_model.model.model.layers."
_HF_MODULES = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}


def peft_tensors(modules: list[str], get: Callable[[str], torch.Tensor],
                 cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT key, tensor) for every adapted native module path (``decoder.layers.{L}.<module>``)."""
    for path in modules:
        _, _, layer, rest = path.split(".", 3)
        if rest not in _HF_MODULES:
            raise BadInput(f"LoRA on {path} has no Hugging Face counterpart", field="save_lora_to_hf")
        a, b = get(path + ".lora_A.weight"), get(path + ".lora_B.weight")
        if rest.endswith("linear_qkv"):
            pieces = split_qkv(b, cfg)
        elif rest.endswith("linear_fc1"):
            pieces = split_fc1(b)
        else:
            pieces = (b,)
        for hf_module, piece in zip(_HF_MODULES[rest], pieces):
            prefix = f"{PEFT_PREFIX}{layer}.{hf_module}"
            yield prefix + ".lora_A.weight", a.contiguous().clone()
            yield prefix + ".lora_B.weight", piece.contiguous().clone()


def save_peft_adapter(modules: list[str], get: Callable[[str], torch.Tensor], cfg: ModelConfig,
                      out_dir: str | os.PathLike[str], r: int, alpha: float, dtype: torch.dtype | None = None,
                      base_model_name_or_path: str | None = None) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` into ``out_dir``; returns the directory."""
    if not modules:
        raise BadInput("the checkpoint holds no LoRA adapters (lora_A/lora_B keys) to export", field="save_lora_to_hf")
    tensors = {k: (t.to(dtype) if dtype else t) for k, t in peft_tensors(modules, get, cfg)}
    targets = sorted({k[len(PEFT_PREFIX):].split(".", 1)[1].rsplit(".lora_", 1)[0].split(".")[-1] for k in tensors})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".adapter_model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "use_rslora": False, "modules_to_save": None, "base_model_name_or_path": base_model_name_or_path,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


class LoraOverlay:
    """A base checkpoint (HF, or anything with ``get_native``) with a Megatron LoRA checkpoint merged on top.

    This is how the trainer's adapter-only saves meet their base (``args.lora_base``, often an HF directory):
    every adapted weight becomes W + alpha/r · B @ A, cut per target TP shard like MindSpeed's merge.
    """

    def __init__(self, base: Any, lora_dir: str | os.PathLike[str], lora_alpha: float | None, lora_r: int | None):
        from engine.checkpoint.megatron import RankFiles

        self.base, self.config = base, base.config
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
        return merge_lora(weight, a, b, self.lora_alpha, self.lora_r)

    def lora_modules(self) -> list[str]:
        return self.lora.lora_modules()

    def lora_tensor(self, key: str) -> torch.Tensor:
        return self.lora.full(key)
