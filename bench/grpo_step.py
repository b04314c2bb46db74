"""One GRPO step: this engine's stage grpo vs TRL's ``GRPOTrainer``, same model, prompts and settings.

CPU, fp32, one intra-op thread per side, each side in its own fresh process. Model: ``bench/common/qwen3.py``'s Qwen3
shape (random weights saved once as an HF checkpoint both sides load; ``--smoke``: its one-layer hidden-64 shape).
Prompts: ``bench/dpo_step.py``'s seed-like intent questions in Qwen3's chat template; the reward is an exact match of
the answer with the intent label (a Python function on TRL's side, ``exact_match`` on ours). Both sides: ``--prompts``
prompts × ``--num-generations`` completions a step (one micro-batch), ``--max-completion-length`` new tokens at
temperature 1, beta 0 (TRL's default: no reference), loss dapo, AdamW, clip 1.0, constant LR. A random model
almost never stops, so both sides decode the full completion length and train on equal token counts.

Both sides time generation and training apart: ours its rollout (generation, scoring, advantages, old log-probs) and
its optimizer step (the job's ``GRPOLoop.make_rollout`` and ``step``, wrapped with a clock); TRL's the same part of
its step (``GRPOTrainer._generate_and_score_completions``, wrapped) and the rest of the step (a callback's clock).
One warm-up step, then ``--repeats`` timed steps, the fastest counted. Each side runs in fresh processes, ``--pairs``
pairs of them (ours, TRL; then TRL, ours; ...: ``bench/common/pairs.py``); every ratio is the median of the pairs'
ratios, with min, max and count. tokens/s: generation = completion tokens / generation time; training and step =
(prompt + completion tokens) / training time and / the whole step. Peak memory = peak RSS minus RSS after imports.
Prints one JSON line per process, then ``{"bench":"grpo_step",...}``.
Run: ``.venv/bin/python bench/grpo_step.py [--smoke]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common.allocator import add_malloc_flag, apply_to_children  # noqa: E402
from bench.common.memory import peak_mb  # noqa: E402
from bench.common.pairs import add_step_pair_flags, alternate, pair_ratios  # noqa: E402
from bench.common.qwen3 import SHAPE, SMOKE_SHAPE, write_side_models  # noqa: E402
from bench.common.seed_data import INTENTS, UTTERANCES  # noqa: E402
from bench.common.seed_data import tokenizer_dir as _tokenizer_dir  # noqa: E402


def make_prompts(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        skills = "、".join(rng.sample(INTENTS, rng.randint(3, len(INTENTS))))
        question = f"技能：{skills}\n用户：{rng.choice(UTTERANCES)}\n用户最后一句话所属的技能和意图是："
        out.append({"question": question, "answer": rng.choice(INTENTS)})
    return out


def write_prompts(prompts: list[dict[str, str]], prefix: Path) -> tuple[str, int]:
    """The prompts as instruction data (chat-templated prompt, the label as the assistant turn); (prefix, the
    prompts' total tokens)."""
    import numpy as np
    from transformers import AutoTokenizer

    from engine.contract.indexed import IndexedDatasetWriter, instruction_prefix

    tok = AutoTokenizer.from_pretrained(_tokenizer_dir())
    writers = {
        f: IndexedDatasetWriter(instruction_prefix(str(prefix), f)) for f in ("input_ids", "attention_mask", "labels")
    }
    total = 0
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p["question"]}], add_generation_prompt=True,
                                       tokenize=False)  # fmt: skip
        prompt, reply = tok.encode(text), tok.encode(p["answer"] + "<|im_end|>")
        total += len(prompt)
        writers["input_ids"].add_document(np.array(prompt + reply))
        writers["attention_mask"].add_document(np.ones(len(prompt) + len(reply)))
        writers["labels"].add_document(np.array([-100] * len(prompt) + reply))
    for w in writers.values():
        w.finalize()
    return str(prefix), total


def run_ours(work: Path, steps: int, prompts: int, g: int, length: int) -> dict[str, list[float]]:
    from bench.common.trl import matched_spec
    from engine.contract.runfiles import RunDir
    from engine.contract.spec import TrainSpec, parse_spec
    from engine.train import entry, grpo

    times: dict[str, list[float]] = {"generation_s": [], "train_s": []}

    def clocked(method: Any, key: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = method(*args, **kwargs)
            times[key].append(time.perf_counter() - started)
            return out

        return wrapper

    grpo.GRPOLoop.make_rollout = clocked(grpo.GRPOLoop.make_rollout, "generation_s")  # type: ignore[method-assign]
    grpo.GRPOLoop.step = clocked(grpo.GRPOLoop.step, "train_s")  # type: ignore[method-assign]
    spec = {
        **matched_spec(steps),
        "stage": "grpo",
        "data_path": [str(work / "prompts")],
        "load": str(work / "model"),
        "tokenizer_name_or_path": str(_tokenizer_dir()),
        "micro_batch_size": prompts * g,
        "global_batch_size": prompts * g,
        "num_generations": g,
        "max_completion_length": length,
        "reward_funcs": [{"name": "exact_match"}],
    }
    entry.run(cast(TrainSpec, parse_spec(spec)), RunDir(work / "run"))
    return times


def run_trl(work: Path, steps: int, prompts: list[dict[str, str]], g: int, length: int) -> dict[str, list[float]]:
    from datasets import Dataset  # type: ignore[import-untyped]
    from transformers import AutoTokenizer, Qwen3ForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from bench.common.trl import StepClock, matched_args

    generation: list[float] = []
    inner = GRPOTrainer._generate_and_score_completions

    def generate_clocked(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = inner(self, *args, **kwargs)
        generation.append(time.perf_counter() - started)
        return out

    GRPOTrainer._generate_and_score_completions = generate_clocked  # type: ignore[method-assign]

    def exact_match(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float | None]:
        return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]

    model = Qwen3ForCausalLM.from_pretrained(work / "model")
    clock = StepClock()
    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": p["question"]}] for p in prompts],
            "answer": [p["answer"] for p in prompts],
        }
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=GRPOConfig(
            **matched_args(work, steps),
            per_device_train_batch_size=len(prompts) // steps * g,  # one step's prompts, as ours
            num_generations=g,
            max_completion_length=length,
            temperature=1.0,
            beta=0.0,
            loss_type="dapo",
        ),
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(_tokenizer_dir()),
        callbacks=[clock],
    )
    trainer.train()
    if len(generation) != len(clock.times):
        raise RuntimeError(f"TRL generated {len(generation)} times in {len(clock.times)} steps")
    train = [step - gen for step, gen in zip(clock.times, generation, strict=True)]
    return {"generation_s": generation, "train_s": train, "step_s": clock.times}


def measure(side: str, work: str, steps: int, prompts: list, g: int, length: int, threads: int) -> dict:
    """In a fresh process: import both stacks, run, report."""
    from bench.common.trl import start_side

    rss0 = start_side(threads)
    if side == "ours":
        times = run_ours(Path(work) / "ours", steps, len(prompts) // steps, g, length)  # prompts holds every step's
        times["step_s"] = [a + b for a, b in zip(times["generation_s"], times["train_s"], strict=True)]
    else:
        times = run_trl(Path(work) / "trl", steps, prompts, g, length)
    return {"side": side, **times, "peak_mem_mb": peak_mb() - rss0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, help="prompts a step")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=64)
    add_step_pair_flags(
        parser, rival="TRL", repeats=2, smoke="a one-layer hidden-64 model, 2 × 4 completions of 8, 1 pair"
    )
    add_malloc_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.num_generations, args.max_completion_length, args.pairs = 1, 4, 8, 1
    g, length, steps = args.num_generations, args.max_completion_length, 1 + args.repeats
    prompts = make_prompts(args.prompts * steps, args.seed)
    apply_to_children(args.malloc)
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shape = SMOKE_SHAPE if args.smoke else SHAPE
        write_side_models(work, ("ours", "trl"), shape, args.seed, max_position_embeddings=40960)
        _, prompt_tokens = write_prompts(prompts, work / "ours" / "prompts")
        per_step_prompt_tokens = prompt_tokens / steps * g  # each prompt's tokens feed its g completions
        completion_tokens = args.prompts * g * length
        print(json.dumps({"prompts_per_step": args.prompts, "completion_tokens_per_step": completion_tokens}))

        def run(side: str) -> dict[str, Any]:
            for stale in ("run", "trl"):  # a fresh run directory for each process (ours would resume from it)
                shutil.rmtree(work / side / stale, ignore_errors=True)
            with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                return pool.submit(measure, side, tmp, steps, prompts, g, length, args.threads).result()

        pairs = alternate(run, ("ours", "trl"), args.pairs, log=lambda r: print(json.dumps(r)))
    step_tokens = per_step_prompt_tokens + completion_tokens
    tokens = {"generation_s": completion_tokens, "train_s": step_tokens, "step_s": step_tokens}

    def tps(result: dict[str, Any], key: str) -> float:
        """tokens/s of a process's fastest timed step (the least disturbed on a shared machine)."""
        return tokens[key] / min(result[key][1:])

    ratios = {key: [tps(p["ours"], key) / tps(p["trl"], key) for p in pairs] for key in tokens}
    mem = [p["ours"]["peak_mem_mb"] / p["trl"]["peak_mem_mb"] for p in pairs]
    print(
        json.dumps(
            {
                "bench": "grpo_step",
                "smoke": args.smoke,
                **pair_ratios("tokens_per_s_ratio", ratios["step_s"]),
                **pair_ratios("generation_tokens_per_s_ratio", ratios["generation_s"]),
                **pair_ratios("train_tokens_per_s_ratio", ratios["train_s"]),
                **pair_ratios("peak_mem_ratio", mem),
                **{
                    f"{side}_{key.removesuffix('_s')}_tokens_per_s": round(
                        statistics.median(tps(p[side], key) for p in pairs), 1
                    )
                    for side in ("ours", "trl")
                    for key in tokens
                },
                **{
                    f"{side}_peak_mem_mb": round(statistics.median(p[side]["peak_mem_mb"] for p in pairs), 1)
                    for side in ("ours", "trl")
                },
                "num_generations": g,
                "max_completion_length": length,
                "repeats": args.repeats,
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
