"""The one torch-free checkpoint inspector: which format a directory holds, the Megatron tracker → iteration
directory, what its tensors are (``contents``: LoRA adapters or full weights), and (``engine.contract.plan.shape``)
the model shape of any checkpoint kind. Admission and the engine's loaders
both call it, so a directory the service admits is one the engine can open.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickletools
import re
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine.contract.runfiles import BadInput

if TYPE_CHECKING:
    from pydantic import BaseModel

    from engine.contract.model_config import ModelConfig

log = logging.getLogger(__name__)

Format = Literal["hf", "mcore", "native"]
TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_MCORE_ENTRY = re.compile(r"^(iter_\d{7}|release|mp_rank_\d\d)")


def checkpoint_format(p: Path) -> Format | None:
    """``hf`` (config.json + safetensors), ``mcore`` (a tracker or ``iter_*``/``mp_rank_*`` folders), ``native``
    (torch DCP ``.metadata``, ours), or None when the directory holds none of them."""
    names = {e.name for e in p.iterdir()}
    if "config.json" in names and any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        return "hf"
    if _dcp_inside(p):
        return "native"
    if TRACKER in names or any(_MCORE_ENTRY.match(n) for n in names):
        return "mcore"
    return None


def _dcp_inside(p: Path) -> bool:
    if (p / ".metadata").is_file():
        return True
    tracker = p / TRACKER
    if tracker.is_file():
        step = read_tracker(tracker)
        sub = p / (f"iter_{int(step):07d}" if step.isascii() and step.isdigit() else step)
        return (sub / ".metadata").is_file()
    return any((d / ".metadata").is_file() for d in p.glob("iter_*"))


def read_tracker(tracker: Path) -> str:
    """The tracker's word (an iteration number or ``release``): its first 64 bytes, whatever the file's size."""
    with tracker.open("rb") as f:
        return f.read(64).decode("utf-8", "replace").strip()


def iteration_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def resolve_iteration_dir(root: str | os.PathLike[str]) -> tuple[Path, int | str | None]:
    """The directory holding the ``mp_rank_*`` folders, and its iteration, following Megatron's tracker rules."""
    root = Path(root)
    if not root.is_dir():
        raise BadInput(f"{root}: checkpoint directory not found", field="load_dir")
    if any(_RANK_DIR_RE.match(p.name) for p in root.iterdir()):
        return root, None  # pointed straight at iter_XXXXXXX/
    tracker = root / TRACKER
    iters = sorted(p for p in root.glob("iter_[0-9]*") if p.is_dir())
    if not tracker.is_file():
        if not iters:
            raise BadInput(
                f"{root}: no {TRACKER} and no iter_*/ directory: not a Megatron checkpoint", field="load_dir"
            )
        log.warning("%s: no %s; using the newest directory %s", root, TRACKER, iters[-1].name)
        return iters[-1], int(iters[-1].name[5:])
    text = read_tracker(tracker)
    if text == "release":
        if not (root / "release").is_dir():
            found = f" but the checkpoint has {', '.join(p.name for p in iters)}" if iters else ""
            raise BadInput(
                f"{tracker}: says 'release'{found}; an iteration number is needed (e.g. "
                f"{int(iters[-1].name[5:]) if iters else 1})",
                field="load_dir",
            )
        return root / "release", "release"
    try:
        iteration = int(text)
    except ValueError:
        raise BadInput(
            f"{tracker}: must hold an iteration number or 'release', found {text[:40]!r}", field="load_dir"
        ) from None
    if iteration <= 0:
        raise BadInput(f"{tracker}: iteration must be positive, found {iteration}", field="load_dir")
    path = root / iteration_dir_name(iteration)
    if not path.is_dir():
        raise BadInput(f"{tracker}: says iteration {iteration} but {path} does not exist", field="load_dir")
    return path, iteration


# ---------------------------------------------------------------- what a checkpoint holds

_LORA_KEY = re.compile(r"(?:^|\.)lora_[AB](?:\.|$)")
_BASE_KEY = re.compile(r"^(?:module\.)*(?:embedding|decoder|output_layer|model|lm_head)\.\S*(?:weight|bias)$")
_PICKLE_LIMIT = 16 << 20  # a rank file's data.pkl: names and args, well under 1 MB even for large models


@dataclasses.dataclass(frozen=True)
class Contents:
    """What a checkpoint's tensors are: LoRA adapters (``lora``), and whether it needs a base model to load
    (adapters only, no base weights beside them)."""

    lora: bool
    needs_base_model: bool

    @classmethod
    def of_names(cls, names: Iterable[str]) -> Contents:
        lora = base = False
        for name in names:
            if _LORA_KEY.search(name):
                lora = True
            elif _BASE_KEY.match(name):
                base = True
        return cls(lora=lora, needs_base_model=lora and not base)


FULL = Contents(lora=False, needs_base_model=False)


def contents(path: str | os.PathLike[str]) -> Contents | None:
    """What the checkpoint at ``path`` holds, read from its tensors' names without torch and without unpickling:
    an HF / PEFT directory's safetensors headers, our training state's ``meta.json`` (``trainable_only``: LoRA
    adapters alone), a Megatron checkpoint's first rank file (its ``data.pkl`` scanned for key strings). None when
    the path holds nothing this reads (absent, unknown, unreadable)."""
    p = Path(path)
    if not p.is_dir():
        return None
    try:
        if (p / "adapter_config.json").is_file():
            return Contents(lora=True, needs_base_model=True)  # a PEFT adapter directory
        if (p / "meta.json").is_file():
            return _training_state(p / "meta.json")
        tensors = sorted(p.glob("*.safetensors"))
        if tensors:
            return Contents.of_names(n for f in tensors for n in _safetensors_names(f))
        rank_file = _first_rank_file(p)
        return Contents.of_names(_pickle_strings(rank_file)) if rank_file else None
    except (OSError, ValueError, zipfile.BadZipFile, BadInput):
        return None


def _training_state(meta: Path) -> Contents:
    saved = json.loads(meta.read_bytes()[: 1 << 20])
    lora = isinstance(saved, dict) and bool(saved.get("trainable_only"))
    return Contents(lora=lora, needs_base_model=lora)


def _safetensors_names(path: Path) -> list[str]:
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > 100 << 20:
            raise ValueError(f"{path}: header of {size} bytes")
        header = json.loads(f.read(size))
    return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []


def _first_rank_file(root: Path) -> Path | None:
    iter_dir = root if any(_RANK_DIR_RE.match(p.name) for p in root.iterdir()) else None
    if iter_dir is None:
        if (root / ".metadata").is_file():
            return None
        iter_dir, _ = resolve_iteration_dir(root)
    ranks = sorted(d / "model_optim_rng.pt" for d in iter_dir.iterdir() if _RANK_DIR_RE.match(d.name))
    return next((r for r in ranks if r.is_file()), None)


def _pickle_strings(rank_file: Path) -> Iterator[str]:
    """The strings a torch zip file's ``data.pkl`` holds (its state dict's keys among them), by walking the
    opcodes (``pickletools.genops`` builds nothing and runs no code)."""
    with zipfile.ZipFile(rank_file) as z:
        name = next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if name is None or z.getinfo(name).file_size > _PICKLE_LIMIT:
            return
        data = z.read(name)
    for _, arg, _ in pickletools.genops(io.BytesIO(data)):
        if isinstance(arg, str):
            yield arg


# ---------------------------------------------------------------- the spec flags a checkpoint sets

# spec flag -> (ModelConfig field, how the flag's value maps onto it)
SHAPE_FLAGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "num_layers": ("num_layers", int),
    "hidden_size": ("hidden_size", int),
    "ffn_hidden_size": ("ffn_hidden_size", int),
    "num_attention_heads": ("num_attention_heads", int),
    "kv_channels": ("kv_channels", int),
    "padded_vocab_size": ("vocab_size", int),
    "norm_epsilon": ("norm_epsilon", float),
    "rotary_base": ("rotary_base", float),
    "untie_embeddings_and_output_weights": ("tie_word_embeddings", lambda untie: not untie),
    "num_experts": ("num_experts", int),
    "moe_router_topk": ("moe_router_topk", int),
    "moe_ffn_hidden_size": ("expert_ffn_hidden_size", int),
    "moe_intermediate_size": ("expert_ffn_hidden_size", int),
}
# What this engine builds whatever the flags' Megatron defaults say (it runs Qwen3: RMSNorm, RoPE, SwiGLU, QK norm,
# no linear biases); ``engine.load.weights.check_model_kind`` refuses an explicit flag asking for another.
QWEN3_FLAGS: dict[str, Any] = {
    "normalization": "RMSNorm",
    "position_embedding_type": "rope",
    "use_rotary_position_embeddings": True,
    "swiglu": True,
    "qk_layernorm": True,
    "disable_bias_linear": True,
}


def checkpoint_flags(cfg: ModelConfig, spec: BaseModel | type[BaseModel]) -> dict[str, Any]:
    """The spec's flags as the checkpoint's shape sets them (the inverse of ``SHAPE_FLAGS``, GQA and MoE too), for
    the fields ``spec`` (a spec or its class) has. A run records them (a ``config`` event) and the API's effective
    spec shows them, where the schema's defaults (rotary_base 10000, ...) would otherwise be shown."""
    moe_only = {"num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_intermediate_size"}
    flags: dict[str, Any] = {
        flag: getattr(cfg, field) for flag, (field, _) in SHAPE_FLAGS.items() if cfg.is_moe or flag not in moe_only
    }  # a dense checkpoint sets no MoE flag
    flags["untie_embeddings_and_output_weights"] = not cfg.tie_word_embeddings
    flags["group_query_attention"] = cfg.num_query_groups != cfg.num_attention_heads
    flags["num_query_groups"] = cfg.num_query_groups
    flags["max_position_embeddings"] = cfg.max_position_embeddings
    cls = spec if isinstance(spec, type) else type(spec)
    fields = cls.model_fields
    return {flag: value for flag, value in flags.items() if flag in fields}
