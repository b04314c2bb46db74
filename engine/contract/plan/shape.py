"""The model shape a job will train or evaluate, found without torch (the API process calls this).

Sources, first that applies: the ``load`` checkpoint's HF ``config.json`` (or, for a Megatron checkpoint, the
``args`` namespace inside an ``mp_rank_*`` file, read through the engine's one allow-list with every torch and
NumPy global inert, in a child process under a byte, time and memory budget: ``engine.contract.rank_args``), else a
named preset, else the spec's Megatron flags with Megatron's defaults. Every size taken from a file is checked by
type and range before it is computed with (``check_sizes``).
The checkpoint's shape wins over shape flags: the trainer refuses a disagreement before any work
(``engine.load.weights.check_against_checkpoint``).

``config_from_flags`` is the one rule for a model built from flags: the trainer calls it too
(``engine.load.weights.config_from_flags`` turns ``ShapeUnknown`` into its ``BadInput``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.contract import rope_scaling
from engine.contract.inspect import _RANK_DIR_RE, resolve_iteration_dir
from engine.contract.model_config import ModelConfig, moe_fields_from_flags, moe_from_args, preset
from engine.contract.rank_args import SHAPE_ARGS, read_rank_args
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


# Sizes a real model stays far within: a file's number past them is refused, never computed with (the layout rule
# and the planner iterate over layers and multiply sizes). Keys: Megatron's args, ModelConfig's and HF's names.
_SIZE_LIMITS: dict[str, int] = {
    **dict.fromkeys(("num_layers", "num_hidden_layers", "decoder_sparse_step"), 4096),
    **dict.fromkeys(("hidden_size",), 1 << 20),
    **dict.fromkeys(("ffn_hidden_size", "intermediate_size", "moe_ffn_hidden_size", "moe_intermediate_size"), 1 << 22),
    **dict.fromkeys(
        ("num_attention_heads", "num_query_groups", "num_key_value_heads", "kv_channels", "head_dim"), 1 << 16
    ),
    **dict.fromkeys(("num_experts", "num_local_experts", "moe_router_topk", "num_experts_per_tok"), 1 << 16),
    **dict.fromkeys(("padded_vocab_size", "vocab_size"), 1 << 24),
    **dict.fromkeys(("max_position_embeddings", "rope_scaling_original_max_position_embeddings"), 1 << 24),
}
_FLAGS = ("swiglu", "group_query_attention", "untie_embeddings_and_output_weights", "norm_topk_prob")
_MAX_JSON_BYTES = 1 << 20  # a config.json / meta.json is a few KB


def _why_bad(name: str, value: object) -> str | None:
    """Why a shape field's value cannot be used (None: it can, or it is unset)."""
    if value is None:
        return None
    if name in _SIZE_LIMITS:
        ok = type(value) is int and 0 <= value <= _SIZE_LIMITS[name]
        return None if ok else f"not an integer in 0..{_SIZE_LIMITS[name]}"
    if name in _FLAGS:
        return None if type(value) is bool else "not true or false"
    if name == "rope_scaling_type":
        return None if type(value) is str else "not a name"
    if name == "mlp_only_layers":
        ok = type(value) is list and all(type(i) is int and 0 <= i < 4096 for i in value)
        return None if ok else "not a list of layer numbers"
    ok = (type(value) is int or type(value) is float) and math.isfinite(value)
    return None if ok else "not a finite number"


def _show(value: object) -> str:
    if isinstance(value, dict) and "unreadable" in value:
        return f"a {value['unreadable']}"
    return f"{value!r:.60}"


def check_sizes(fields: dict[str, Any], where: str, field: str, lenient: bool = False) -> None:
    """``BadInput`` naming the first shape field of a file that is of the wrong type or out of range; ``lenient``
    (an HF config.json, read field by field by admission) lets values of another type pass."""
    for name, value in fields.items():
        if name not in SHAPE_ARGS and name not in _SIZE_LIMITS:
            continue
        if lenient and not (type(value) is int and name in _SIZE_LIMITS):
            continue
        why = _why_bad(name, value)
        if why is not None:
            raise BadInput(f"{where}: {name} is {_show(value)}: {why}", field=field)


def read_json(path: Path, field: str) -> Any:  # Any: JSON's value (callers check its shape)
    """A checkpoint's small JSON file, at most ``_MAX_JSON_BYTES``; ``BadInput`` naming ``field`` otherwise."""
    with path.open("rb") as f:
        data = f.read(_MAX_JSON_BYTES + 1)
    if len(data) > _MAX_JSON_BYTES:
        raise BadInput(f"{path}: over {_MAX_JSON_BYTES} bytes (a model's config is a few KB)", field=field)
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise BadInput(f"{path}: not readable JSON ({type(err).__name__})", field=field) from None


def _mcore_args(root: Path, field: str) -> tuple[Path, dict[str, Any]] | None:
    try:
        iter_dir, _ = resolve_iteration_dir(root)
    except BadInput:
        return None  # no Megatron layout here (a DCP checkpoint, say): the engine tells at run time
    ranks = sorted(p for p in iter_dir.glob("mp_rank_*") if _RANK_DIR_RE.match(p.name))
    for rank in ranks:
        path = rank / "model_optim_rng.pt"
        if not path.is_file():
            continue
        fields = read_rank_args(path, field)
        if fields is not None:
            check_sizes(fields, f"{path}: args", field)
            return path, fields
    return None


def _from_mcore_args(fields: dict[str, Any]) -> ModelConfig | None:
    get: Callable[[str], Any] = fields.get
    if not all(get(k) for k in ("num_layers", "hidden_size", "num_attention_heads")):
        return None
    heads = get("num_attention_heads")
    vocab = get("padded_vocab_size") or get("vocab_size")
    if not vocab:
        return None
    args = argparse.Namespace(**fields)
    return ModelConfig(
        num_layers=get("num_layers"),
        hidden_size=get("hidden_size"),
        ffn_hidden_size=get("ffn_hidden_size") or _megatron_ffn(get("hidden_size"), bool(get("swiglu"))),
        num_attention_heads=heads,
        num_query_groups=(get("num_query_groups") or 1) if get("group_query_attention") else heads,
        kv_channels=get("kv_channels") or get("hidden_size") // heads,
        vocab_size=vocab,
        tie_word_embeddings=not get("untie_embeddings_and_output_weights"),
        **({"max_position_embeddings": get("max_position_embeddings")} if get("max_position_embeddings") else {}),
        **moe_from_args(args, get("num_layers")),
        **rope_scaling.from_args(args),
    )


def _json_config(root: Path, field: str) -> ModelConfig | None:
    """The shape of an HF config.json or of our own training checkpoint's meta.json; None when it holds none."""
    for candidate in (root / "config.json", root / "hf" / "config.json"):
        if candidate.is_file():
            config = read_json(candidate, field)
            if not isinstance(config, dict):
                return None
            check_sizes(config, str(candidate), field, lenient=True)
            try:
                return ModelConfig.from_hf(config)
            except (KeyError, ValueError, TypeError):
                return None
    meta = root / "meta.json"  # our own training checkpoint (engine.checkpoint.dcp)
    if meta.is_file():
        saved = read_json(meta, field)
        config = saved.get("model_config") if isinstance(saved, dict) else None
        if not isinstance(config, dict):
            return None
        check_sizes(config, f"{meta}: model_config", field)
        try:
            return ModelConfig(**config)
        except (KeyError, ValueError, TypeError):
            return None
    return None


def checkpoint_config(path: str | Path, field: str = "load") -> ModelConfig | None:
    """The shape stored in a checkpoint directory, None when it holds none that can be read without torch;
    ``BadInput`` naming ``field`` when a file that holds it is refused, out of bounds or cannot be read within the
    limits (``engine.contract.rank_args``). Admission turns that into a 422."""
    root = Path(path)
    if not root.is_dir():
        return None  # not there yet (a pipeline step's output)
    if any(p.is_file() for p in (root / "config.json", root / "hf" / "config.json", root / "meta.json")):
        return _json_config(root, field)
    try:
        found = _mcore_args(root, field)
    except OSError:
        return None
    if found is None:
        return None
    rank_file, fields = found
    try:
        return _from_mcore_args(fields)
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as err:
        raise BadInput(f"{rank_file}: args describe no model this engine runs ({err})", field=field) from None


def config_from_checkpoint(path: str | Path) -> ModelConfig | None:
    """``checkpoint_config`` for the planner: None also when a file is refused (the engine refuses it with its
    reason at run time; admission has refused it already at submission)."""
    try:
        return checkpoint_config(path)
    except BadInput:
        return None


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
