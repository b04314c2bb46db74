"""LoRA adapters of ``lora_load`` (eval, serve): read, checked against the spec, wrapped onto the model.

Adapters are applied on the loaded base with ``engine.model.lora`` and never merged into it, so what is evaluated
is exactly what was trained (MindSpeed's "independent" mode: every non-adapter tensor in the adapter checkpoint
overrides the base, ``X.base_layer.weight`` read as ``X.weight``). A Hugging Face PEFT adapter directory (trained
with ``peft`` elsewhere) is merged into the base instead, as each weight is read (``lora_merge.PeftOverlay``): its
q/k/v adapters have separate A matrices, which no unmerged fused LoRA of the same rank can hold.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Mapping
from typing import Any

import torch

from engine.checkpoint.lora_merge import PeftOverlay
from engine.checkpoint.sources import WeightSource
from engine.contract.guard import private_copy
from engine.contract.runfiles import BadInput
from engine.contract.spec import EvalSpec, ServeSpec
from engine.load.weights import given, refield

log = logging.getLogger(__name__)

_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[ABab])(?:\.default)?\.weight$")
# Megatron's local linear layers save an ``_extra_state`` entry (None) next to their weights; nothing to load.
_SKIP_SUFFIXES = ("._extra_state",)


def _mcore_adapters(spec: EvalSpec | ServeSpec) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from engine.checkpoint.load import detect_format
    from engine.checkpoint.megatron_read import MegatronCheckpoint, load_rank_file
    from engine.contract.inspect import resolve_iteration_dir
    from engine.model.lora import from_mindspeed_keys

    if detect_format(given(spec.load, "load")) == "mcore":  # adapters sharded like their base: TP/PP pieces glued
        ckpt = MegatronCheckpoint(given(spec.load, "load"), lora_dir=spec.lora_load, field="load")
        state = {
            f"{m}.lora_{ab}.weight": ckpt.lora_tensor(f"{m}.lora_{ab}.weight")
            for m in ckpt.lora_modules()
            for ab in "AB"
        }
        return state, {"alpha": ckpt.lora_alpha, "r": ckpt.lora_r}
    iter_dir, _ = resolve_iteration_dir(given(spec.lora_load, "lora_load"))
    files = sorted(iter_dir.glob("mp_rank_*/model_optim_rng.pt"))
    if len(files) != 1:
        raise BadInput(
            f"lora_load: {iter_dir} is sharded ({len(files)} rank files); over a non-Megatron base only "
            "TP1/PP1 adapter checkpoints can be read",
            field="lora_load",
        )
    raw = load_rank_file(files[0])
    args = raw.get("args")
    state = from_mindspeed_keys({k: v for k, v in raw["model"].items() if isinstance(v, torch.Tensor)})
    return state, {"alpha": getattr(args, "lora_alpha", None), "r": getattr(args, "lora_r", None)}


def read_adapters(spec: EvalSpec | ServeSpec) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(adapter checkpoint tensors, recorded LoRA settings) of ``lora_load``: ours (DCP) or Megatron/MindSpeed, read
    from a copy made without following links (``engine.contract.guard.private_copy``: a link swapped into the folder
    after the start-up check is refused, never read through)."""
    lora = given(spec.lora_load, "lora_load")
    with private_copy("lora_load", lora) as copy:
        try:
            return _read_adapters(spec.model_copy(update={"lora_load": copy}))
        except BadInput as err:  # name the user's folder, not the private copy
            raise BadInput(str(err).replace(copy, lora), field=err.field) from err


def _read_adapters(spec: EvalSpec | ServeSpec) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from engine.checkpoint.load import detect_format

    lora = given(spec.lora_load, "lora_load")
    try:
        fmt = detect_format(lora)
        if fmt == "native":
            from engine.checkpoint import dcp

            meta, state = dcp.load_model_weights(lora)
            return dict(state), dict(meta.get("lora") or {})
        if fmt == "mcore":
            return _mcore_adapters(spec)
    except BadInput as err:
        raise refield(err, "lora_load") from err
    raise BadInput(
        f"lora_load: {spec.lora_load} is an HF model directory, not a LoRA checkpoint (give the adapters "
        "saved by a LoRA training job, ours or MindSpeed's)",
        field="lora_load",
    )


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


@dataclasses.dataclass
class Adapters:
    """An adapter checkpoint checked against the spec: base overrides, LoRA tensors and the LoRA settings."""

    base: dict[str, torch.Tensor]
    lora: dict[str, torch.Tensor]
    r: int
    alpha: float
    targets: list[str]

    def facts(self) -> dict[str, Any]:
        return {
            "lora_r": self.r,
            "lora_alpha": self.alpha,
            "lora_targets": self.targets,
            "lora_tensors": len(self.lora),
        }


def check_adapters(
    spec: EvalSpec | ServeSpec, adapter_state: Mapping[str, torch.Tensor], recorded: Mapping[str, Any] | None = None
) -> Adapters:
    """The adapters of ``lora_load`` with their rank, alpha and targets, checked against the spec's LoRA flags."""
    base, lora = split_adapters(adapter_state)
    if not lora:
        raise BadInput(
            f"lora_load: {spec.lora_load} holds no LoRA tensors (no *.lora_A.weight keys)", field="lora_load"
        )
    ranks = sorted({t.shape[0] for k, t in lora.items() if k.endswith("lora_A.weight")})
    if len(ranks) != 1:
        raise BadInput(f"lora_load: adapters have mixed ranks {ranks}", field="lora_load")
    r = ranks[0]
    if spec.lora_r is not None and spec.lora_r != r:
        raise BadInput(f"lora_r: {spec.lora_r} but the adapters in {spec.lora_load} have rank {r}", field="lora_r")
    alpha = spec.lora_alpha if spec.lora_alpha is not None else (recorded or {}).get("alpha")
    if alpha is None:
        alpha = 32.0  # MindSpeed's default --lora-alpha
        log.warning("lora_alpha: not given and not recorded with the adapters; using MindSpeed's default 32")
    targets = sorted({k.rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in lora})  # <module>.lora_A.weight
    if spec.lora_target_modules and set(spec.lora_target_modules) != set(targets):
        log.warning(
            "lora_target_modules %s differ from the adapters found %s; using the adapters",
            spec.lora_target_modules,
            targets,
        )
    return Adapters(base, lora, r, float(alpha), targets)


def wrap_adapters(model: torch.nn.Module, adapters: Adapters) -> None:
    """Wrap the targeted modules of ``model`` (on meta or not) with unmerged LoRA; refuse adapter or override
    tensors that do not fit it."""
    from engine.model.lora import apply_lora

    stray = sorted(set(adapters.base) - set(model.state_dict()))
    if stray:
        raise BadInput(f"lora_load: unexpected tensors {stray[:5]}", field="lora_load")
    apply_lora(model, r=adapters.r, alpha=adapters.alpha, dropout=0.0, targets=adapters.targets)
    own = model.state_dict()
    wrong = [k for k in adapters.lora if k not in own or tuple(own[k].shape) != tuple(adapters.lora[k].shape)]
    if wrong:
        raise BadInput(
            f"lora_load: adapter tensors do not fit the model (r={adapters.r}): {wrong[:5]}", field="lora_load"
        )


def peft_source(base: WeightSource, spec: EvalSpec | ServeSpec, dtype: torch.dtype) -> PeftOverlay:
    """``base`` with a Hugging Face PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``) added in
    fp32 as each weight is read, then cast to ``dtype``."""
    overlay = PeftOverlay(base, given(spec.lora_load, "lora_load"), spec.lora_alpha, dtype=dtype)
    if spec.lora_r is not None and spec.lora_r != overlay.facts["lora_r"]:
        raise BadInput(
            f"lora_r: {spec.lora_r} but the adapter in {spec.lora_load} has rank {overlay.facts['lora_r']}",
            field="lora_r",
        )
    return overlay
