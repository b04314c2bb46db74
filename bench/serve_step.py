"""One decode step of the serving loop, with and without the bf16 greedy head (``engine.serve.greedy_head``): where
the time of a step goes at ``--seqs`` running greedy sequences on the bench model of ``bench/common/qwen3.py`` (a
random Qwen3, hidden 512, 8 layers, the real 151,936-token vocabulary; built here, not loaded).

Two batchers over copies of the same model, the same prompts, prefilled; then ``--steps`` decode steps each,
alternating A (full fp32 head) and B (greedy head). Per side, the median step and its parts: the layers' forward
(``Batcher._compute``), the head and the picks (``Batcher._emit_all``; on B the greedy head alone too), and the step's
CPU time (``step_cpu``, all threads: on a loaded machine wall times swing with the other processes, CPU time much
less). Checks that both decoded the same tokens. The last line is one JSON object.

    .venv/bin/python bench/serve_step.py [--seqs 32] [--steps 6] [--threads N] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from bench.common.qwen3 import SHAPE  # noqa: E402


def _timed(store: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        store.append(time.perf_counter() - start)
        return out

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the default)")
    parser.add_argument("--smoke", action="store_true", help="4 sequences, 2 steps, 2 layers")
    args = parser.parse_args()
    import torch
    from transformers import Qwen3Config

    from engine.contract.model_config import ModelConfig
    from engine.model.qwen3 import Qwen3Model
    from engine.serve.batcher import Batcher, Sequence
    from engine.serve.sampling import RequestOptions
    from engine.serve.slots import SlotCache

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.seqs, args.steps = 4, 2
    hf = Qwen3Config(**{**SHAPE, "num_hidden_layers": 2 if args.smoke else SHAPE["num_hidden_layers"]})
    cfg = ModelConfig.from_hf(hf.to_dict())
    torch.manual_seed(0)
    model = Qwen3Model(cfg)
    model.init_weights(seed=0)
    prompts = [torch.randint(0, cfg.vocab_size, (20,)).tolist() for _ in range(args.seqs)]
    parts: dict[str, dict[str, list[float]]] = {}
    sides = {}
    for name, fast in (("full_fp32_head", False), ("bf16_greedy_head", True)):
        batcher = Batcher(copy.deepcopy(model).eval(), SlotCache(cfg, args.seqs, 256), set(), bf16_greedy_head=fast)
        seqs = [Sequence(p, RequestOptions(temperature=0.0), 10_000) for p in prompts]
        batcher.submit(seqs)
        batcher.step()  # the prompts
        batcher.step()  # a first decode (warm)
        times = parts[name] = {"step": [], "step_cpu": [], "layers": [], "head_and_picks": [], "greedy_head": []}
        batcher._compute = _timed(times["layers"], batcher._compute)  # type: ignore[method-assign]
        batcher._emit_all = _timed(times["head_and_picks"], batcher._emit_all)  # type: ignore[method-assign]
        if batcher.greedy_head is not None:
            head = batcher.greedy_head
            head.argmax = _timed(times["greedy_head"], head.argmax)  # type: ignore[method-assign]
        sides[name] = (batcher, seqs)
    for _ in range(args.steps):  # A B A B
        for name, (batcher, _) in sides.items():
            start, cpu = time.perf_counter(), time.process_time()
            batcher.step()
            parts[name]["step"].append(time.perf_counter() - start)
            parts[name]["step_cpu"].append(time.process_time() - cpu)  # every thread's CPU: steadier under load
    medians = {n: {k: round(statistics.median(v), 4) for k, v in p.items() if v} for n, p in parts.items()}
    same = [s.output for s in sides["full_fp32_head"][1]] == [s.output for s in sides["bf16_greedy_head"][1]]
    for name, row in medians.items():
        print(name, row)
    ratio = medians["full_fp32_head"]["step"] / medians["bf16_greedy_head"]["step"]
    print(f"step time ratio (full / greedy head): {ratio:.2f}; same tokens: {same}")
    result = {"bench": "serve_step", "smoke": args.smoke, "seqs": args.seqs, "threads": torch.get_num_threads()}
    result |= {"load": round(os.getloadavg()[0], 1), "sides": medians, "ratio": round(ratio, 3), "same_tokens": same}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
