"""One way for the serving tests to run ``python -m engine serve``'s runner in this process and wait until ready."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.contract.runfiles import RunDir
from engine.contract.spec import ServeSpec
from engine.serve.job import run


@contextmanager
def running_engine(run_dir: Path, metrics_interval_s: float = 5.0, **spec: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(the endpoint's URL, the runner's summary, filled in once it stopped) of a serve job built from ``spec``."""
    rundir = RunDir(run_dir)
    stop = threading.Event()
    summary: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: summary.update(run(ServeSpec(**spec), rundir, stop, metrics_interval_s)[1]), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 120
    while not (rundir.path / "serve.json").is_file():
        assert thread.is_alive() and time.monotonic() < deadline, "the engine never became ready"
        time.sleep(0.2)
    try:
        yield json.loads((rundir.path / "serve.json").read_text())["url"], summary
    finally:
        stop.set()
        thread.join(timeout=60)


def write_lora_checkpoint(hf_dir: Path, save: Path, seed: int, r: int, alpha: float, targets: list[str]) -> Path:
    """The iteration directory of a LoRA training checkpoint as a LoRA train job saves it (``engine.checkpoint.dcp``, adapter tensors only,
    ``meta["lora"]``), over the HF model ``hf_dir``, its B drawn at random (as after training) so it changes tokens."""
    import torch
    import torch.distributed as dist

    from engine.checkpoint import dcp
    from engine.load.inference import build_model
    from engine.model.lora import apply_lora

    model, _, _ = build_model(ServeSpec(load=str(hf_dir)))
    apply_lora(model, r=r, alpha=alpha, targets=targets, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        meta = {"lora": {"r": r, "alpha": alpha, "targets": targets}, "trainable_only": True}  # as train jobs write
        return dcp.save(save, 1, model, None, meta, trainable_only=True, save_rng=False)
    finally:
        dist.destroy_process_group()


def merged_hf_model(hf_dir: Path, lora: Path) -> Any:
    """transformers' Qwen3 with the adapters of ``lora`` merged into its weights (``engine.model.lora.merge_into``):
    the reference a served adapter must decode like."""
    from transformers import Qwen3ForCausalLM

    from engine.load.inference import build_model
    from engine.model.hf_mapping import hf_from_native
    from engine.model.lora import merge_into

    model, cfg, _ = build_model(ServeSpec(load=str(hf_dir), lora_load=str(lora)))
    merge_into(model)
    state = dict(hf_from_native(model.state_dict().__getitem__, cfg))
    hf = Qwen3ForCausalLM.from_pretrained(hf_dir).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    return hf
