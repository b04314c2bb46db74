"""The ``convert`` job: MindSpeed-LLM's ``convert_ckpt.py`` (HF <-> Megatron, re-sharding, LoRA merge/export).

Directions: hf->mg, mg->hf (from Megatron/MindSpeed checkpoints or the trainer's own), mg->mg (new TP/PP),
hf->hf (dtype/shards). LoRA adapters found in a Megatron source are merged per TP shard (``--lora-r``/``--lora-alpha``
or the checkpoint's args; ``--lora-load`` overlays a separate LoRA checkpoint), or exported alone as a PEFT adapter
(``--save-lora-to-hf``). For HF output into an existing HF model directory the result goes to ``<save_dir>/mg2hf``
(MindSpeed v1's convention, which the seed's scripts rely on: ``cp -rf models/Qwen3-4B/mg2hf ...``).
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from tqdm import tqdm

from engine.checkpoint.hf import HFCheckpoint, as_getter, copy_tokenizer, save_hf
from engine.checkpoint.layout import FINAL_NORM
from engine.checkpoint.load import detect_format, open_checkpoint
from engine.checkpoint.lora_merge import LoraOverlay, PeftOverlay, is_peft_adapter, save_peft_adapter
from engine.checkpoint.megatron_read import MegatronCheckpoint
from engine.checkpoint.megatron_write import save_mcore
from engine.checkpoint.sources import WeightSource
from engine.contract import layout
from engine.contract.guard import check_output
from engine.contract.lora_targets import resolve_targets
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput, RunDir
from engine.contract.spec import ConvertSpec
from engine.dtypes import DTYPES

log = logging.getLogger(__name__)


class _Progress:
    """tqdm bar on stderr plus at most one ``progress`` event per second in the run directory."""

    def __init__(self, run: RunDir, unit: str):
        self.run, self.unit, self.last = run, unit, 0.0
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = tqdm(total=total, unit=self.unit, file=sys.stderr, disable=None)
        self.bar.update(done - self.bar.n)
        now = time.monotonic()
        if done == total or now - self.last >= 1.0:
            self.last = now
            self.run.progress(done, total, self.unit)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# the layout rule names the training flags; a convert job's own fields for the same degrees
_TARGET_FIELDS = {
    "tensor_model_parallel_size": "target_tensor_parallel_size",
    "pipeline_model_parallel_size": "target_pipeline_parallel_size",
    "expert_model_parallel_size": "target_expert_parallel_size",
}


def _hf_target(spec: ConvertSpec) -> tuple[Path, Path | None]:
    """(output directory, HF directory to take config/generation files from)."""
    save = Path(spec.save_dir)
    if (save / "config.json").is_file():
        return save / "mg2hf", save
    return save, Path(spec.hf_cfg_dir) if spec.hf_cfg_dir else None


def _json(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise BadInput(f"{path}: not valid JSON ({err})", field="save_dir") from err


def _hf_reference(spec: ConvertSpec) -> dict[str, Any] | None:
    """An HF config.json that tells a Megatron source what its tensors cannot (epsilon, RoPE base, true vocab)."""
    candidates = [_hf_target(spec)[1], Path(spec.hf_cfg_dir) if spec.hf_cfg_dir else None]
    if spec.tokenizer_model:
        tok = Path(spec.tokenizer_model)
        candidates.append(tok if tok.is_dir() else tok.parent)
    for directory in candidates:
        config = _json(directory / "config.json") if directory else None
        if config:
            return config
    return None


def _open_source(spec: ConvertSpec, run: RunDir) -> tuple[ModelConfig, WeightSource]:
    fmt = detect_format(spec.load_dir)
    if spec.load_model_type == "hf":
        if fmt != "hf":
            raise BadInput(
                f"{spec.load_dir}: load_model_type is hf but this is a {fmt} checkpoint", field="load_model_type"
            )
        return _with_lora(spec, HFCheckpoint(spec.load_dir), run)
    if fmt == "hf":
        raise BadInput(
            f"{spec.load_dir}: load_model_type is mg but this is an HF model directory", field="load_model_type"
        )
    if fmt == "native":
        return _with_lora(spec, open_checkpoint(spec.load_dir)[1], run)
    if spec.lora_load and is_peft_adapter(spec.lora_load):
        ckpt = MegatronCheckpoint(spec.load_dir, hf_config=_hf_reference(spec))
        return ckpt.config, _peft_overlay(spec, ckpt, spec.lora_load)
    ckpt = MegatronCheckpoint(
        spec.load_dir,
        lora_dir=spec.lora_load,
        lora_alpha=spec.lora_alpha,
        lora_r=spec.lora_r,
        hf_config=_hf_reference(spec),
    )
    ckpt.merge_rounding = spec.lora_merge_rounding
    _check_lora(spec, ckpt, run)
    return ckpt.config, ckpt


def _with_lora(spec: ConvertSpec, base: WeightSource, run: RunDir) -> tuple[ModelConfig, WeightSource]:
    """An HF or training-checkpoint base, with ``lora_load``'s adapters (Megatron's, ours or PEFT's) merged on top."""
    if not spec.lora_load:
        return base.config, base
    if is_peft_adapter(spec.lora_load):
        return base.config, _peft_overlay(spec, base, spec.lora_load)
    source = LoraOverlay(base, spec.lora_load, spec.lora_alpha, spec.lora_r, spec.lora_merge_rounding)
    _check_lora(spec, source, run)
    return source.config, source


def _peft_overlay(spec: ConvertSpec, base: WeightSource, lora_load: str) -> PeftOverlay:
    overlay = PeftOverlay(base, lora_load, spec.lora_alpha)
    if spec.lora_r is not None and spec.lora_r != overlay.facts["lora_r"]:
        raise BadInput(
            f"lora_r: {spec.lora_r} but the adapter in {spec.lora_load} has rank {overlay.facts['lora_r']}",
            field="lora_r",
        )
    return overlay


def _check_lora(spec: ConvertSpec, ckpt: WeightSource, run: RunDir) -> None:
    modules = ckpt.lora_modules()
    if not modules:
        if spec.lora_r is not None or spec.lora_load:
            run.event("warning", "no LoRA adapters found in the checkpoint; converting the base weights as they are")
        return
    if spec.lora_target_modules:
        try:
            targets = set(resolve_targets(spec.lora_target_modules))
        except ValueError as err:
            raise BadInput(f"lora_target_modules: {err}", field="lora_target_modules") from err
        stray = sorted({m.rsplit(".", 1)[1] for m in modules} - targets)
        if stray:
            raise BadInput(
                f"lora_target_modules: the checkpoint has adapters on {', '.join(stray)}, "
                f"not among {', '.join(sorted(targets))}",
                field="lora_target_modules",
            )


def _to_mcore(
    spec: ConvertSpec, cfg: ModelConfig, source: WeightSource, dtype: torch.dtype, progress: _Progress
) -> tuple[Path, list[Path]]:
    dims = spec.target_parallel_dims
    tp, pp, ep = dims.tp, dims.pp, dims.ep
    try:
        layout.check(cfg, dims, spec.num_layer_list, spec.num_layers_per_virtual_pipeline_stage)
    except layout.LayoutError as err:  # a convert job names its layout target_*
        field = _TARGET_FIELDS.get(err.field, err.field)
        raise BadInput(f"{field}: {err.why}", field=field) from err
    files = save_mcore(
        source,
        cfg,
        spec.save_dir,
        tp=tp,
        pp=pp,
        num_layer_list=spec.num_layer_list,
        vpp_layers=spec.num_layers_per_virtual_pipeline_stage,
        dtype=dtype,
        progress=progress,
        ep=ep,
        grouped=spec.moe_grouped_gemm,
    )
    return Path(spec.save_dir), files


def _to_hf(
    spec: ConvertSpec, cfg: ModelConfig, source: WeightSource, dtype: torch.dtype, progress: _Progress
) -> tuple[Path, list[Path]]:
    out, reference = _hf_target(spec)
    if spec.load_model_type == "hf" and reference is None:
        reference = Path(spec.load_dir)
    hf_config = _json(reference / "config.json") if reference else None
    generation = _json(reference / "generation_config.json") if reference else None
    files = save_hf(source, cfg, out, dtype=dtype, hf_config=hf_config, generation_config=generation, progress=progress)
    tokenizer_src = spec.tokenizer_model or spec.hf_cfg_dir
    if tokenizer_src:
        copy_tokenizer(tokenizer_src, out)
    return out, files


@runtime_checkable
class _Adapters(Protocol):
    """A Megatron checkpoint's LoRA adapters, as a PEFT export reads them."""

    @property
    def lora_r(self) -> int | None: ...
    @property
    def lora_alpha(self) -> float | None: ...
    def lora_modules(self) -> list[str]: ...
    def lora_tensor(self, key: str) -> torch.Tensor: ...


def _to_adapter(
    spec: ConvertSpec, cfg: ModelConfig, source: WeightSource, dtype: torch.dtype
) -> tuple[Path, list[Path]]:
    if not isinstance(source, _Adapters):
        raise BadInput("save_lora_to_hf: adapters are read from Megatron checkpoints only", field="save_lora_to_hf")
    r = spec.lora_r or source.lora_r
    alpha = spec.lora_alpha or source.lora_alpha
    if r is None or alpha is None:
        raise BadInput(
            "lora_r: the checkpoint args do not say the LoRA rank/alpha; give lora_r and lora_alpha", field="lora_r"
        )
    out, reference = _hf_target(spec)
    path = save_peft_adapter(
        source.lora_modules(),
        source.lora_tensor,
        cfg,
        out,
        r=r,
        alpha=alpha,
        dtype=dtype,
        base_model_name_or_path=str(reference) if reference else None,
    )
    return path, [path / "adapter_model.safetensors"]


def _peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM, not ru_maxrss: the latter keeps the parent's size across fork + exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(spec: ConvertSpec, run: RunDir) -> tuple[dict[str, str], dict[str, Any]]:
    """Convert ``spec.load_dir`` into ``spec.save_dir``; returns (outputs, summary) for result.json."""
    start = time.perf_counter()
    cfg, source = _open_source(spec, run)
    dtype = DTYPES[spec.params_dtype] if spec.params_dtype else as_getter(source)(FINAL_NORM).dtype
    progress = _Progress(run, "tensors")
    check_output("save_dir", spec.save_dir)  # right before writing (engine.contract.guard)
    try:
        if spec.save_lora_to_hf:
            out, files = _to_adapter(spec, cfg, source, dtype)
        elif spec.save_model_type == "mg":
            out, files = _to_mcore(spec, cfg, source, dtype, progress)
        else:
            out, files = _to_hf(spec, cfg, source, dtype, progress)
    finally:
        progress.close()
    seconds = time.perf_counter() - start
    sizes = [f.stat().st_size for f in files]
    summary = {
        "direction": f"{spec.load_model_type}->{'peft' if spec.save_lora_to_hf else spec.save_model_type}",
        "num_layers": cfg.num_layers,
        "tied": cfg.tie_word_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
        "tensor_parallel": spec.target_tensor_parallel_size if spec.save_model_type == "mg" else 1,
        "pipeline_parallel": spec.target_pipeline_parallel_size if spec.save_model_type == "mg" else 1,
        "expert_parallel": spec.target_expert_parallel_size if spec.save_model_type == "mg" else 1,
        "files": len(files),
        "bytes": sum(sizes),
        "largest_file_bytes": max(sizes, default=0),
        "lora_merged": bool(
            getattr(source, "lora_merged", False)
            or (hasattr(source, "lora_modules") and source.lora_modules() and not spec.save_lora_to_hf)
        ),
        "seconds": round(seconds, 3),
        "peak_rss_mb": round(_peak_rss_bytes() / 2**20, 1),
    }
    log.info(
        "converted %s -> %s in %.1fs (%d files, %.1f MB)", spec.load_dir, out, seconds, len(files), sum(sizes) / 1e6
    )
    return {"checkpoint": str(out.resolve())}, summary
