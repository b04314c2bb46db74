"""Which checkpoint format a path holds, and loading model weights from any of them as native tensors.

- ``hf``: a directory with config.json and safetensors (``engine.checkpoint.hf``);
- ``mcore``: Megatron/MindSpeed legacy layout, a tracker or ``iter_*``/``mp_rank_*`` folders (``engine.checkpoint.megatron_read``);
- ``native``: the trainer's own distributed checkpoints (torch DCP ``.metadata``), read by ``engine.checkpoint.dcp``
  (owned by the trainer).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch

from engine.checkpoint.hf import HFCheckpoint
from engine.checkpoint.megatron_read import MegatronCheckpoint
from engine.checkpoint.sources import WeightSource
from engine.contract.inspect import TRACKER, Format, checkpoint_format
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput
from engine.model.hf_mapping import native_keys


def detect_format(path: str | os.PathLike[str]) -> Format:
    """Raise BadInput when ``path`` is none of the known formats (``engine.contract.inspect.checkpoint_format``)."""
    p = Path(path)
    if not p.is_dir():
        raise BadInput(f"{p}: checkpoint directory not found", field="load_dir")
    fmt = checkpoint_format(p)
    if fmt is None:
        raise BadInput(
            f"{p}: neither an HF model (config.json + *.safetensors), a Megatron checkpoint "
            f"({TRACKER}, iter_*/mp_rank_*) nor a training checkpoint (.metadata)",
            field="load_dir",
        )
    return fmt


def open_checkpoint(path: str | os.PathLike[str]) -> tuple[ModelConfig, WeightSource]:
    """(config, reader implementing ``sources.WeightSource``) without reading any tensor data yet."""
    fmt = detect_format(path)
    if fmt == "hf":
        hf = HFCheckpoint(path)
        return hf.config, hf
    if fmt == "mcore":
        mcore = MegatronCheckpoint(path)
        return mcore.config, mcore
    source = _open_native(path)
    return source.config, source


def load_model_weights(path: str | os.PathLike[str]) -> tuple[ModelConfig | None, dict[str, torch.Tensor]]:
    """(config, full native state dict) of an HF, Megatron or training checkpoint."""
    cfg, ckpt = open_checkpoint(path)
    return cfg, {k: ckpt.get_native(k) for k in native_keys(cfg)}


def _open_native(path: str | os.PathLike[str]) -> WeightSource:
    try:
        dcp = importlib.import_module("engine.checkpoint.dcp")
    except ModuleNotFoundError:
        raise BadInput(
            f"{path}: a training (DCP) checkpoint, but engine.checkpoint.dcp is not available", field="load_dir"
        ) from None
    try:
        source = dcp.DcpWeights(path)
    except ValueError as err:
        raise BadInput(str(err), field="load_dir") from err
    if source.meta.get("lora"):
        raise BadInput(
            f"{path}: a LoRA training state holds adapters only; convert the run's final checkpoint "
            f"(<save>/iter_*) with lora_load, or give the base as load_dir",
            field="load_dir",
        )
    return source
