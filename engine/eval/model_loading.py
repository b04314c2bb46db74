"""Build the model an eval job runs: checkpoint (any of our formats) + model-shape flags + optional LoRA adapters.

The checkpoint decides the shape when it carries one (HF ``config.json``, Megatron ``args``, our training
checkpoints); shape flags given on the command line must then agree with it, as Megatron's
``check_checkpoint_args`` insists — a mismatch is a ``BadInput`` naming the flag (the trainer's
``engine.train.model_setup`` rules, shared), never a silent reshape or a shape error deep inside
``load_state_dict``. A checkpoint without a shape (an mcore checkpoint saved without ``args``) takes it from the
flags.

LoRA adapters (``lora_load``) are applied on the loaded base with ``engine.model.lora`` and never merged into it, so
what is evaluated is exactly what was trained (MindSpeed's "independent" mode: every non-adapter tensor in the adapter
checkpoint overrides the base, ``X.base_layer.weight`` read as ``X.weight``). A Hugging Face PEFT adapter directory
(trained with ``peft`` elsewhere) is merged into the base instead, as each weight is read (``lora_merge.PeftOverlay``):
its q/k/v adapters have separate A matrices, which no unmerged fused LoRA of the same rank can hold.

The model is built on the ``meta`` device and filled in the dtype it runs in from the checkpoint's reader
(``engine.checkpoint.sources.WeightSource``), one tensor at a time.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch

from engine.checkpoint.lora_merge import PeftOverlay, is_peft_adapter
from engine.checkpoint.sharded import fill_parts
from engine.checkpoint.sources import WeightSource
from engine.dtypes import DTYPES
from engine.model.config import ModelConfig
from engine.model.qwen3 import Qwen3Model
from engine.runfiles import BadInput
from engine.train.model_setup import check_against_checkpoint, check_model_kind

log = logging.getLogger(__name__)

_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[ABab])(?:\.default)?\.weight$")
# Megatron's local linear layers save an ``_extra_state`` entry (None) next to their weights; nothing to load.
_SKIP_SUFFIXES = ("._extra_state",)


def _refield(err: BadInput, field: str) -> BadInput:
    """The checkpoint readers speak of ``load_dir`` (the convert job's flag); name this job's flag instead."""
    return BadInput(str(err) if str(err).startswith(field) else f"{field}: {err}", field=field)


def _mcore_adapters(spec: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from engine.checkpoint.load import detect_format
    from engine.checkpoint.megatron import MegatronCheckpoint, load_rank_file, resolve_iteration_dir
    from engine.model.lora import from_mindspeed_keys

    if detect_format(spec.load) == "mcore":  # adapters sharded like their base: the reader glues TP/PP pieces
        ckpt = MegatronCheckpoint(spec.load, lora_dir=spec.lora_load)
        state = {f"{m}.lora_{ab}.weight": ckpt.lora_tensor(f"{m}.lora_{ab}.weight")
                 for m in ckpt.lora_modules() for ab in "AB"}
        return state, {"alpha": ckpt.lora_alpha, "r": ckpt.lora_r}
    iter_dir, _ = resolve_iteration_dir(spec.lora_load)
    files = sorted(iter_dir.glob("mp_rank_*/model_optim_rng.pt"))
    if len(files) != 1:
        raise BadInput(f"lora_load: {iter_dir} is sharded ({len(files)} rank files); over a non-Megatron base only "
                       "TP1/PP1 adapter checkpoints can be read", field="lora_load")
    raw = load_rank_file(files[0])
    args = raw.get("args")
    state = from_mindspeed_keys({k: v for k, v in raw["model"].items() if isinstance(v, torch.Tensor)})
    return state, {"alpha": getattr(args, "lora_alpha", None), "r": getattr(args, "lora_r", None)}


def read_adapters(spec: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(adapter checkpoint tensors, recorded LoRA settings) of ``lora_load``: ours (DCP) or Megatron/MindSpeed."""
    from engine.checkpoint.load import detect_format

    try:
        fmt = detect_format(spec.lora_load)
        if fmt == "native":
            from engine.checkpoint import dcp

            meta, state = dcp.load_model_weights(spec.lora_load)
            return dict(state), dict(meta.get("lora") or {})
        if fmt == "mcore":
            return _mcore_adapters(spec)
    except BadInput as err:
        raise _refield(err, "lora_load") from err
    raise BadInput(f"lora_load: {spec.lora_load} is an HF model directory, not a LoRA checkpoint (give the adapters "
                   "saved by a LoRA training job, ours or MindSpeed's)", field="lora_load")


def split_adapters(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base overrides, LoRA tensors keyed ``<module>.lora_A.weight``) of an adapter checkpoint."""
    base, lora = {}, {}
    for key, tensor in state.items():
        if key.endswith(_SKIP_SUFFIXES):
            continue
        m = _LORA_KEY.match(key)
        if m:
            lora[f"{m['module']}.lora_{m['ab'].upper()}.weight"] = tensor
        else:
            base[key.replace(".base_layer.weight", ".weight")] = tensor
    return base, lora


def load_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into ``model``; every key must exist with its shape and every model tensor must be given."""
    own = model.state_dict()
    state = {k: v for k, v in state.items() if not k.endswith(_SKIP_SUFFIXES)}
    if "output_layer.weight" in state and "output_layer.weight" not in own:
        state.pop("output_layer.weight")  # a tied model's last pipeline stage keeps a copy (megatron-interop.md §2)
    unexpected = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state))
    wrong = [f"{k} {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in own
             if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    problems = []
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) with another shape: " + ", ".join(wrong[:5]))
    if missing:
        problems.append(f"{len(missing)} missing: " + ", ".join(missing[:5]))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: " + ", ".join(unexpected[:5]))
    if problems:
        raise BadInput(f"load: checkpoint {source} does not fit the model: " + "; ".join(problems), field="load")
    model.load_state_dict(state, strict=False)


def apply_adapters(model: torch.nn.Module, spec: Any, adapter_state: Mapping[str, torch.Tensor],
                   recorded: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Wrap the targeted modules with LoRA (unmerged) and load the adapter weights; returns what was applied."""
    from engine.model.lora import apply_lora

    base, lora = split_adapters(adapter_state)
    if not lora:
        raise BadInput(f"lora_load: {spec.lora_load} holds no LoRA tensors (no *.lora_A.weight keys)", field="lora_load")
    if base:
        own = model.state_dict()
        stray = sorted(set(base) - set(own))
        if stray:
            raise BadInput(f"lora_load: unexpected tensors {stray[:5]}", field="lora_load")
        model.load_state_dict(base, strict=False)
    ranks = sorted({t.shape[0] for k, t in lora.items() if k.endswith("lora_A.weight")})
    if len(ranks) != 1:
        raise BadInput(f"lora_load: adapters have mixed ranks {ranks}", field="lora_load")
    r = ranks[0]
    if spec.lora_r is not None and spec.lora_r != r:
        raise BadInput(f"lora_r: --lora-r is {spec.lora_r} but the adapters in {spec.lora_load} have rank {r}",
                       field="lora_r")
    alpha = spec.lora_alpha if spec.lora_alpha is not None else (recorded or {}).get("alpha")
    if alpha is None:
        alpha = 32.0  # MindSpeed's default --lora-alpha
        log.warning("lora_alpha: not given and not recorded with the adapters; using MindSpeed's default 32")
    targets = sorted({k.rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in lora})  # <module>.lora_A.weight
    if spec.lora_target_modules and set(spec.lora_target_modules) != set(targets):
        log.warning("lora_target_modules %s differ from the adapters found %s; using the adapters", spec.lora_target_modules, targets)
    apply_lora(model, r=r, alpha=alpha, dropout=0.0, targets=targets)
    own = model.state_dict()
    wrong = [k for k in lora if k not in own or tuple(own[k].shape) != tuple(lora[k].shape)]
    if wrong:
        raise BadInput(f"lora_load: adapter tensors do not fit the model (r={r}): {wrong[:5]}", field="lora_load")
    model.load_state_dict(lora, strict=False)
    return {"lora_r": r, "lora_alpha": alpha, "lora_targets": targets, "lora_tensors": len(lora)}


def peft_source(base: WeightSource, spec: Any, dtype: torch.dtype) -> PeftOverlay:
    """``base`` with a Hugging Face PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``) added in
    fp32 as each weight is read, then cast to ``dtype``."""
    overlay = PeftOverlay(base, spec.lora_load, spec.lora_alpha, dtype=dtype)
    if spec.lora_r is not None and spec.lora_r != overlay.facts["lora_r"]:
        raise BadInput(f"lora_r: --lora-r is {spec.lora_r} but the adapter in {spec.lora_load} has rank "
                       f"{overlay.facts['lora_r']}", field="lora_r")
    return overlay


def open_source(path: str, field: str = "load") -> WeightSource:
    """The reader of an HF directory, a Megatron checkpoint or one of our training checkpoints (no tensor read)."""
    from engine.checkpoint.load import open_checkpoint

    try:
        return open_checkpoint(path)[1]
    except BadInput as err:
        raise _refield(err, field) from err
    except FileNotFoundError as err:
        raise BadInput(f"{field}: {err}", field=field) from err


def build_model(spec: Any, vocab_hint: int | None = None) -> tuple[Qwen3Model, ModelConfig, dict[str, Any]]:
    """The eval model on the host, in eval mode and in the dtype it runs in, plus facts for the summary.

    Built on the meta device, materialised in the run's dtype and filled tensor by tensor from the checkpoint's
    reader (each weight cast as it arrives): a bf16 model is never built in fp32 first."""
    check_model_kind(spec)
    source = open_source(spec.load)
    cfg = source.config
    check_against_checkpoint(spec, cfg, spec.load)
    dtype = DTYPES["bf16" if spec.bf16 else "fp16" if spec.fp16 else "fp32"]
    info: dict[str, Any] = {}
    if spec.lora_load and is_peft_adapter(spec.lora_load):
        source = peft_source(source, spec, dtype)
        info.update(source.facts)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    model = model.to(dtype).to_empty(device="cpu")
    try:
        fill_parts([model], source)
    except (KeyError, ValueError) as err:
        raise BadInput(f"load: checkpoint {spec.load} does not fit the model: {err}", field="load") from err
    info["num_params"] = sum(p.numel() for p in model.parameters())
    if spec.lora_load and not is_peft_adapter(spec.lora_load):
        adapter_state, recorded = read_adapters(spec)
        info.update(apply_adapters(model, spec, adapter_state, recorded))
    return model.to(dtype=dtype).eval(), cfg, info
