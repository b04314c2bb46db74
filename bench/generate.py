"""Batched greedy decoding throughput: ``engine.eval.generate`` vs ``transformers``' ``generate``.

Same random Qwen3 weights (loaded into both through ``engine.model.hf_mapping``), same chat-template prompts of
different lengths (left-padded), same batch, same number of new tokens, both greedy with a KV cache, in one run.
The two sides alternate run by run (``--reps`` pairs, ``bench/common/pairs.py``). Prints one line per side and a
closing JSON line ``{"bench": "generate", "tokens_per_s_ratio": median of the pairs' ours / theirs, ...}``.

    .venv/bin/python bench/generate.py [--device cpu|cuda] [--batch 8] [--new-tokens 32] [--layers 4] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common.pairs import alternate, pair_ratios  # noqa: E402
from bench.common.seed_data import tokenizer_dir  # noqa: E402
from engine.contract.model_config import ModelConfig
from engine.eval.generate import DecodeOptions, generate_batch
from engine.model.hf_mapping import native_from_hf
from engine.model.qwen3 import Qwen3Model

PAD, STOPS = 151643, (151643, 151645)
QUESTIONS = [
    "广州塔为什么也叫小蛮腰",
    "明天北京天气怎么样？",
    "播放周杰伦的歌",
    "turn off the kitchen lights please",
    "给妈妈打电话",
    "设置一个早上七点的闹钟，别忘了",
    "hi",
    "what is the capital of France, and why?",
]


def _prompts(batch: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir())
    out = []
    for i in range(batch):
        msgs = [
            {"role": "system", "content": "You are a helpful assistant."},
            {
                "role": "user",
                "content": f"请你判读用户的意图。交互历史：用户：{QUESTIONS[i % len(QUESTIONS)]}" * (1 + i % 3),
            },
        ]
        out.append(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False))
    return out


def _models(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[Qwen3ForCausalLM, Qwen3Model]:
    cfg = ModelConfig(args.layers, args.hidden, args.hidden * 3, args.heads, args.groups, args.hidden // args.heads)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**{**cfg.to_hf("float32"), "initializer_range": 0.1})).eval()
    ours = Qwen3Model(cfg)
    ours.load_state_dict(dict(native_from_hf(hf.state_dict().__getitem__, cfg)))
    return hf.to(device, dtype), ours.to(device, dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _run_ours(model: Qwen3Model, prompts: list[list[int]], new: int, device: torch.device):
    opts = DecodeOptions(max_new_tokens=new, stop_ids=STOPS, pad_id=PAD)

    def go():
        gen = generate_batch(model, model.cfg, prompts, opts)
        _sync(device)
        return gen.num_generated, gen.tokens

    return go


def _run_hf(model: Qwen3ForCausalLM, prompts: list[list[int]], new: int, device: torch.device):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = {
        "input_ids": ids,
        "attention_mask": mask,
        "max_new_tokens": new,
        "do_sample": False,
        "eos_token_id": list(STOPS),
        "pad_token_id": PAD,
    }

    def go():
        with torch.inference_mode():
            out = model.generate(**kwargs)
        _sync(device)
        rows = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in STOPS), None)
            rows.append(row if cut is None else row[:cut])
        return sum(len(r) + (len(r) < new) for r in rows), rows

    return go


def _measure(ours, theirs, reps: int) -> list[dict[str, tuple[float, tuple]]]:
    """``reps`` pairs of timed runs, the two sides alternating (``bench/common/pairs.py``) so that each pair's two
    runs see about the same machine load."""
    sides = {"ours": ours, "hf": theirs}
    ours(), theirs()  # warm-up
    return alternate(lambda side: _timed(sides[side]), ("ours", "hf"), reps, log=lambda _: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5, help="pairs of timed runs (ours, HF; then HF, ours; ...)")
    parser.add_argument(
        "--smoke", action="store_true", help="2 layers, batch 4, 4 new tokens, one rep: the same code path"
    )
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.batch, args.new_tokens, args.reps = 2, 64, 4, 4, 1
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    hf, ours = _models(args, device, dtype)
    prompts = _prompts(args.batch)
    rounds = _measure(
        _run_ours(ours, prompts, args.new_tokens, device), _run_hf(hf, prompts, args.new_tokens, device), args.reps
    )
    tps = [{side: out[0] / t for side, (t, out) in pair.items()} for pair in rounds]
    (n_ours, rows_ours), (n_hf, rows_hf) = rounds[-1]["ours"][1], rounds[-1]["hf"][1]
    ours_tps, hf_tps = statistics.median(t["ours"] for t in tps), statistics.median(t["hf"] for t in tps)
    print(f"ours:         {n_ours} tokens a run, median {ours_tps:.1f} tokens/s over {len(tps)} runs")
    print(f"transformers: {n_hf} tokens a run, median {hf_tps:.1f} tokens/s over {len(tps)} runs")
    print(
        json.dumps(
            {
                "bench": "generate",
                "smoke": args.smoke,
                **pair_ratios("tokens_per_s_ratio", [t["ours"] / t["hf"] for t in tps]),
                "tokens_per_s": round(ours_tps, 1),
                "transformers_tokens_per_s": round(hf_tps, 1),
                "same_tokens": rows_ours == rows_hf,
                "device": device.type,
                "dtype": str(dtype).split(".")[-1],
                "batch": args.batch,
                "new_tokens": args.new_tokens,
                "prompt_lengths": [len(p) for p in prompts],
                "layers": args.layers,
                "hidden": args.hidden,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
