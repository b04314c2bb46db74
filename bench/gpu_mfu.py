"""Tokens/s/device and MFU of a full-SFT training step on ONE accelerator (not run in CI).

    python bench/gpu_mfu.py --device cuda                       # Qwen3-4B shape, seq 4096, bf16 mixed, selective AC
    python bench/gpu_mfu.py --device cpu --preset qwen3-tiny    # smoke run of the script itself
    python bench/gpu_mfu.py                                     # auto: the accelerator if any, else the cpu smoke run
    python bench/gpu_mfu.py --smoke                             # CI: the cpu smoke run in seconds, whatever is there

Random weights (Megatron init) and random tokens; model = engine.model.qwen3, loss = chunked cross-entropy, AC =
engine.parallel.activation_checkpoint, optimizer = torch AdamW (fused on accelerators). MFU uses the torchtitan
convention (engine.parallel.device.flops_per_token: 6N + 12·L·H·d·S, recompute not credited) against the device's
dense BF16 peak; unknown devices report mfu null. Prints one JSON line {"bench": "gpu_mfu", ...}.
Reference (docs/anchors-engine.md §5): ~35-40% MFU is what torchtitan/Megatron reach for models of this size on H100.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import time

import torch

from engine.contract.model_config import preset
from engine.model.loss import chunked_cross_entropy
from engine.model.qwen3 import Qwen3Model
from engine.parallel.activation_checkpoint import apply_ac
from engine.parallel.device import Device, flops_per_token, import_torch_npu


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cuda", "npu", "cpu"], default="auto")
    p.add_argument("--preset", default=None, help="default qwen3-4b, qwen3-tiny on cpu")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (capped at 256 on cpu)")
    p.add_argument("--mbs", type=int, default=1, help="sequences per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ac", choices=["none", "selective", "full"], default="selective")
    p.add_argument(
        "--precision",
        choices=["bf16-mixed", "bf16", "fp32"],
        default="bf16-mixed",
        help="bf16-mixed = fp32 master weights + bf16 autocast (Megatron --bf16); bf16 = pure bf16",
    )
    p.add_argument("--chunk-size", type=int, default=4096, help="rows per cross-entropy chunk")
    p.add_argument("--smoke", action="store_true", help="CPU, qwen3-tiny, seq 64, one step: the script's code path")
    args = p.parse_args()
    if args.smoke:
        args.device, args.preset, args.seq, args.steps, args.warmup = "cpu", "qwen3-tiny", 64, 1, 1
    return args


def pick_device(name: str) -> Device:
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif importlib.util.find_spec("torch_npu") is not None:
            import_torch_npu()
            name = "npu" if torch.npu.is_available() else "cpu"  # type: ignore[attr-defined]
        else:
            name = "cpu"
    elif name == "npu":
        import_torch_npu()
    return Device(name, 0)  # type: ignore[arg-type]


def build(args: argparse.Namespace, device: Device) -> tuple[Qwen3Model, torch.optim.Optimizer]:
    cfg = preset(args.preset)
    with torch.device("meta"):
        model = Qwen3Model(cfg)
    model.to_empty(device=device.torch_device)
    model.init_weights(seed=0)
    if args.precision == "bf16":
        model.to(torch.bfloat16)
    if args.ac != "none":
        apply_ac(model, args.ac)
    fused = device.type == "cuda"  # the fused AdamW kernel exists for CUDA only
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, fused=fused)
    return model, opt


def step(
    model: Qwen3Model, opt: torch.optim.Optimizer, ids: torch.Tensor, args: argparse.Namespace, device: Device
) -> float:
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if args.precision == "bf16-mixed"
        else contextlib.nullcontext()
    )
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    with autocast:
        hidden = model(ids, return_hidden=True)
        loss_sum, n = chunked_cross_entropy(hidden, model.output_weight(), labels, args.chunk_size)
    (loss_sum / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum.item() / n.item()  # a host sync per step, as a real loop's loss logging


def main() -> None:
    args = parse_args()
    device = pick_device(args.device)
    if device.type == "cpu":
        args.seq = min(args.seq, 256)
    args.preset = args.preset or ("qwen3-tiny" if device.type == "cpu" else "qwen3-4b")
    model, opt = build(args, device)
    cfg = model.cfg
    gen = torch.Generator(device.torch_device).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.mbs, args.seq), device=device.torch_device, generator=gen)
    for _ in range(args.warmup):
        step(model, opt, ids, args, device)
    device.synchronize()
    device.reset_peak_memory()
    start = time.perf_counter()
    losses = [step(model, opt, ids, args, device) for _ in range(args.steps)]
    device.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_s = args.mbs * args.seq * args.steps / seconds
    tflops = flops_per_token(cfg, args.seq) * tokens_per_s / 1e12
    peak = device.peak_tflops()
    print(
        json.dumps(
            {
                "bench": "gpu_mfu",
                "smoke": args.smoke,
                "device": device.name(),
                "preset": args.preset,
                "params": cfg.num_params(),
                "seq": args.seq,
                "mbs": args.mbs,
                "steps": args.steps,
                "ac": args.ac,
                "precision": args.precision,
                "step_s": round(seconds / args.steps, 4),
                "tokens_per_s_per_device": round(tokens_per_s, 1),
                "tflops_per_device": round(tflops, 2),
                "peak_tflops": peak,
                "mfu": round(tflops / peak, 4) if peak else None,
                "flops_per_token": flops_per_token(cfg, args.seq),
                "loss_last": round(losses[-1], 4),
                **{k: round(v, 1) for k, v in device.memory_stats().items()},
            }
        )
    )


if __name__ == "__main__":
    main()
