"""A Hugging Face PEFT adapter folder's LoRA shapes against a base model's, read without torch: the
``adapter_config.json`` and the JSON header of ``adapter_model.safetensors`` (8-byte little-endian length, then
JSON), both with bounded reads since they are user files. Admission (``core.admission``) refuses at submission an
adapter that the engine's merge (``engine.checkpoint.lora_merge.peft_deltas``) would refuse at load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from engine.contract.model_config import ModelConfig

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
CONFIG_LIMIT = 1 << 20  # an adapter config is a few hundred bytes
HEADER_LIMIT = 64 << 20  # the header names every tensor: ~150 bytes each, far below this for any real adapter

# PEFT's key for a LoRA factor of a Qwen3 decoder projection (as ``peft_deltas`` reads it)
PEFT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|mlp)\.[a-z_]+)\.lora_([AB])(?:\.default)?\.weight$"
)


class NotAnAdapter(Exception):
    """The folder's files cannot be read as a PEFT adapter (the message says which and why)."""


def is_peft_adapter(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def projections(base: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each adaptable projection of a decoder layer -> its weight's (out, in) features, as HF lays them out."""
    attention = base.num_attention_heads * base.kv_channels
    kv = base.num_query_groups * base.kv_channels
    shapes = {
        "self_attn.q_proj": (attention, base.hidden_size),
        "self_attn.k_proj": (kv, base.hidden_size),
        "self_attn.v_proj": (kv, base.hidden_size),
        "self_attn.o_proj": (base.hidden_size, attention),
    }
    if not base.num_experts:  # a MoE layer's experts are not adapted by these keys
        ffn = base.ffn_hidden_size
        shapes |= {"mlp.gate_proj": (ffn, base.hidden_size), "mlp.up_proj": (ffn, base.hidden_size)}
        shapes["mlp.down_proj"] = (base.hidden_size, ffn)
    return shapes


def read_header(path: Path) -> dict[str, Any]:
    """The tensors' entries of a safetensors file's header (name -> {"dtype", "shape", "data_offsets"})."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            total = path.stat().st_size
            if size <= 1 or size > HEADER_LIMIT or size > total - 8:
                raise NotAnAdapter(f"{path}: not a safetensors file (a header of {size} bytes in {total})")
            header = json.loads(f.read(size))
    except OSError as err:
        raise NotAnAdapter(f"{path}: not readable ({err.strerror or err})") from None
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise NotAnAdapter(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise NotAnAdapter(f"{path}: not a safetensors file (its header is not a JSON object)")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _shape(path: Path, key: str, entry: Any) -> tuple[int, ...]:
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
        raise NotAnAdapter(f"{path}: tensor {key} has no shape")
    return tuple(shape)


def _rank(path: Path) -> int | None:
    try:
        with path.open("rb") as f:
            config = json.loads(f.read(CONFIG_LIMIT + 1)[:CONFIG_LIMIT])
    except OSError as err:
        raise NotAnAdapter(f"{path}: not readable ({err.strerror or err})") from None
    except (ValueError, RecursionError):
        raise NotAnAdapter(f"{path}: not JSON (or larger than {CONFIG_LIMIT} bytes)") from None
    if not isinstance(config, dict):
        raise NotAnAdapter(f"{path}: not a JSON object")
    r = config.get("r")
    if config.get("rank_pattern") or not isinstance(r, int) or isinstance(r, bool):
        return None  # ranks per module (which the engine's merge refuses) or none given: widths are still checked
    return r


def mismatch(folder: str | Path, base: ModelConfig) -> str | None:
    """Why the PEFT adapter in ``folder`` cannot wrap ``base`` (a layer it lacks, a factor of another width),
    None when every LoRA factor fits. ``NotAnAdapter`` when its files cannot be read as one."""
    folder = Path(folder)
    rank = _rank(folder / CONFIG)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise NotAnAdapter(f"{weights} is missing (adapter_model.bin is not read: save with safetensors)")
    expected = projections(base)
    for key, entry in read_header(weights).items():
        found = PEFT_KEY.match(key)
        if found is None:
            continue  # another module's adapter: the engine names it when it loads
        layer, module, factor = int(found[1]), found[2], found[3]
        shape = _shape(weights, key, entry)
        if layer >= base.num_layers:
            return f"tensor {key} is for layer {layer}; the base (load) has {base.num_layers} layers"
        if module not in expected:
            continue
        out_features, in_features = expected[module]
        if len(shape) != 2:
            return f"tensor {key} has shape {list(shape)}; a LoRA factor is a matrix"
        width, side = (shape[1], in_features) if factor == "A" else (shape[0], out_features)
        if width != side:
            where = "inputs" if factor == "A" else "outputs"
            return (
                f"tensor {key} has shape {list(shape)}: {width} {where}, but the base's (load) {module} has "
                f"{side} (hidden_size {base.hidden_size})"
            )
        inner = shape[0] if factor == "A" else shape[1]
        if rank is not None and inner != rank:
            return f"tensor {key} has shape {list(shape)}; adapter_config.json says r {rank}"
    return None
