"""The model eval and serve run (and the serve trace builds): checkpoint (any of our formats) + model-shape flags +
optional LoRA adapters (``engine.load.adapters``).

The checkpoint decides the shape when it carries one (HF ``config.json``, Megatron ``args``, our training
checkpoints); shape flags given on the command line must then agree with it, as Megatron's
``check_checkpoint_args`` insists — a mismatch is a ``BadInput`` naming the flag (``engine.load.weights``' rules,
the trainer's too), never a silent reshape or a shape error deep inside ``load_state_dict``. A checkpoint without a
shape (an mcore checkpoint saved without ``args``) takes it from the flags.

The model is built on the ``meta`` device and filled in the dtype it runs in from the checkpoint's reader
(``engine.checkpoint.sources.WeightSource``), one tensor at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from engine.checkpoint.lora_merge import is_peft_adapter
from engine.checkpoint.sharded import fill_parts
from engine.checkpoint.sources import TensorDict, WeightSource
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput
from engine.contract.spec import EvalSpec, ServeSpec
from engine.dtypes import DTYPES
from engine.load.adapters import Adapters, check_adapters, peft_source, read_adapters, wrap_adapters
from engine.load.weights import check_against_checkpoint, check_model_kind, given, open_source, with_rope_flags
from engine.model import families
from engine.model.decoder_lm import decoder_lm
from engine.parallel.tensor_parallel import apply_tensor_parallel


def build_model(
    spec: EvalSpec | ServeSpec,
    vocab_hint: int | None = None,
    tp_mesh: DeviceMesh | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.nn.Module, ModelConfig, dict[str, Any]]:
    """The eval or serve model, in eval mode and in the dtype it runs in, plus facts for the summary.

    Built on the meta device (LoRA adapters wrapped there, then sharded over ``tp_mesh`` when given), materialised
    on ``device`` in the run's dtype and filled tensor by tensor from the checkpoint's reader, each rank reading
    only its TP pieces: a bf16 model is never built in fp32 first, and no rank holds a tensor it does not own."""
    check_model_kind(spec)
    load = given(spec.load, "load")
    source: WeightSource = open_source(load)
    cfg = source.config
    check_against_checkpoint(spec, cfg, load)
    cfg = with_rope_flags(spec, cfg)
    dtype = DTYPES["bf16" if spec.bf16 else "fp16" if spec.fp16 else "fp32"]
    info: dict[str, Any] = {}
    adapters: Adapters | None = None
    if spec.lora_load and is_peft_adapter(spec.lora_load):
        overlay = peft_source(source, spec, dtype)
        info.update(overlay.facts)
        source = overlay
    elif spec.lora_load:
        adapters = check_adapters(spec, *read_adapters(spec))
        info.update(adapters.facts())
    with torch.device("meta"):
        model = families.build_model(cfg)
    decoder_lm(model)  # generation reads the DecoderLM's parts: a family's model that lacks one fails here
    info["num_params"] = sum(p.numel() for p in model.parameters())
    lora: WeightSource | None = None
    if adapters is not None:
        wrap_adapters(model, adapters)
        source = TensorDict(cfg, adapters.base, fallback=source)
        lora = TensorDict(cfg, adapters.lora)
    if tp_mesh is not None:
        try:
            apply_tensor_parallel(model, tp_mesh, sequence_parallel=False)  # decoding needs no SP
        except ValueError as err:
            raise BadInput(str(err), field="tensor_model_parallel_size") from err
    model = model.to(dtype).to_empty(device=device)
    try:
        fill_parts([model], source, lora)
    except (KeyError, ValueError) as err:
        raise BadInput(f"load: checkpoint {spec.load} does not fit the model: {err}", field="load") from err
    return model.eval(), cfg, info
