"""The model shape a job will train or evaluate, found without torch (the API process calls this).

Sources, first that applies: the ``load`` checkpoint's HF ``config.json`` (or, for a Megatron checkpoint, the
``args`` namespace inside an ``mp_rank_*`` file, read through the engine's one allow-list with every torch and
NumPy global inert), else a named preset, else the spec's Megatron flags with Megatron's defaults.
The checkpoint's shape wins over shape flags: the trainer refuses a disagreement before any work
(``engine.train.model_setup.check_against_checkpoint``).

``config_from_flags`` is the one rule for a model built from flags: the trainer calls it too
(``engine.train.model_setup.config_from_flags`` turns ``ShapeUnknown`` into its ``BadInput``).
"""

from __future__ import annotations

import argparse
import json
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.contract import rope_scaling
from engine.contract.allow_list import TORCH_FAMILY, SafeUnpickler, on_list, refuse
from engine.contract.inspect import _RANK_DIR_RE, resolve_iteration_dir
from engine.contract.model_config import ModelConfig, moe_fields_from_flags, moe_from_args, preset
from engine.contract.runfiles import BadInput
from engine.contract.spec import ModelSpec


class ShapeUnknown(ValueError):
    """The model shape cannot be told from the spec; ``field`` names the flag that is missing."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


def _megatron_ffn(hidden: int, swiglu: bool) -> int:
    """Megatron's default FFN width: 4h, or for SwiGLU 2/3 of it rounded down to a multiple of 64."""
    return int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden


def _required(value: int | None, flag: str) -> int:
    if value is None:
        raise ShapeUnknown(flag, "required when no checkpoint is loaded (load is not set)")
    return value


def config_from_flags(spec: ModelSpec, tokenizer_vocab: int | None = None) -> ModelConfig:
    """A from-scratch model's shape from the spec's Megatron flags, with Megatron's defaults."""
    layers = _required(spec.num_layers, "num_layers")
    hidden = _required(spec.hidden_size, "hidden_size")
    heads = _required(spec.num_attention_heads, "num_attention_heads")
    vocab = spec.padded_vocab_size
    if vocab is None:
        if tokenizer_vocab is None:
            raise ShapeUnknown("padded_vocab_size", "required without load and without tokenizer_name_or_path")
        multiple = spec.make_vocab_size_divisible_by * spec.tensor_model_parallel_size
        vocab = -(-tokenizer_vocab // multiple) * multiple
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=spec.ffn_hidden_size or _megatron_ffn(hidden, spec.swiglu),
        num_attention_heads=heads,
        num_query_groups=(spec.num_query_groups or 1) if spec.group_query_attention else heads,
        kv_channels=spec.kv_channels or hidden // heads,
        vocab_size=vocab,
        norm_epsilon=spec.norm_epsilon,
        rotary_base=spec.rotary_base,
        max_position_embeddings=spec.max_position_embeddings or spec.seq_length or 4096,
        tie_word_embeddings=not spec.untie_embeddings_and_output_weights,
        init_method_std=spec.init_method_std,
        **moe_fields_from_flags(spec),
        **rope_scaling.from_flags(spec),
    )


class _ArgsUnpickler(SafeUnpickler):
    """A rank file's pickle through the allow-list, without torch: what only torch builds (tensors, storages,
    dtypes, NumPy arrays) becomes an inert stand-in; anything off the list is refused as the engine refuses it."""

    def persistent_load(self, pid: Any) -> Any:
        return None

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] in TORCH_FAMILY:
            if not on_list(module, name):
                raise refuse(f"{module}.{name}", self.path, self.field)
            return _Inert
        return super().find_class(module, name)


class _Inert:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass


def _mcore_args(root: Path) -> argparse.Namespace | None:
    iter_dir, _ = resolve_iteration_dir(root)
    ranks = sorted(p for p in iter_dir.glob("mp_rank_*") if _RANK_DIR_RE.match(p.name))
    for rank in ranks:
        path = rank / "model_optim_rng.pt"
        if not zipfile.is_zipfile(path):
            continue
        with zipfile.ZipFile(path) as zf:
            pkl = next((n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pkl is None:
                continue
            unpickler = _ArgsUnpickler(zf.open(pkl))
            unpickler.path = path
            obj = unpickler.load()
        args = obj.get("args") if isinstance(obj, dict) else None
        if isinstance(args, argparse.Namespace):
            return args
    return None


def _from_mcore_args(args: argparse.Namespace) -> ModelConfig | None:
    get: Callable[[str], Any] = vars(args).get
    if not all(get(k) for k in ("num_layers", "hidden_size", "num_attention_heads")):
        return None
    heads = get("num_attention_heads")
    vocab = get("padded_vocab_size") or get("vocab_size")
    if not vocab:
        return None
    return ModelConfig(
        num_layers=get("num_layers"),
        hidden_size=get("hidden_size"),
        ffn_hidden_size=get("ffn_hidden_size") or _megatron_ffn(get("hidden_size"), bool(get("swiglu"))),
        num_attention_heads=heads,
        num_query_groups=(get("num_query_groups") or 1) if get("group_query_attention") else heads,
        kv_channels=get("kv_channels") or get("hidden_size") // heads,
        vocab_size=vocab,
        tie_word_embeddings=not get("untie_embeddings_and_output_weights"),
        **moe_from_args(args, get("num_layers")),
        **rope_scaling.from_args(args),
    )


def config_from_checkpoint(path: str | Path) -> ModelConfig | None:
    """The shape stored in a checkpoint directory, or None when it holds none that can be read without torch."""
    root = Path(path)
    for candidate in (root / "config.json", root / "hf" / "config.json"):
        if candidate.is_file():
            try:
                return ModelConfig.from_hf(json.loads(candidate.read_text()))
            except (KeyError, ValueError, TypeError):
                return None
    meta = root / "meta.json"  # our own training checkpoint (engine.checkpoint.dcp)
    if meta.is_file():
        try:
            return ModelConfig(**json.loads(meta.read_text())["model_config"])
        except (KeyError, ValueError, TypeError):
            return None
    try:
        args = _mcore_args(root)
    except (OSError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, BadInput):
        return None  # the engine refuses the file with its reason at run time
    return _from_mcore_args(args) if args is not None else None


def model_config(spec: ModelSpec, model: str | None = None) -> tuple[ModelConfig, str]:
    """(shape, where it came from) for a train/eval spec; ``model`` names a preset (``qwen3-4b``)."""
    load = getattr(spec, "load", None)
    if load:
        cfg = config_from_checkpoint(load)
        if cfg is not None:
            return cfg, f"checkpoint {load}"
    if model:
        return preset(model), f"preset {model}"
    return config_from_flags(spec), "flags"
