"""One DPO step: this engine's stage dpo vs TRL's ``DPOTrainer``, same pairs, same weights, a frozen reference copy.

CPU, fp32, one intra-op thread per side, each side in its own fresh process. Model: the Qwen3 shape of
``bench/train_step.py`` (hidden 512, 8 layers, 8 heads / 4 KV groups of 64, FFN 1536, the real 151,936 vocabulary,
tied), random weights saved once as an HF checkpoint both sides load. Pairs shaped like the seed's intent data: a
prompt asking for the intent of an utterance (with a few turns of history), the right intent label as the chosen
answer and another label as the rejected one, tokenized with the real Qwen3 tokenizer as TRL tokenizes them (prompt
without special tokens; answer + ``<|im_end|>``); the TRL side checks its own tokenization equals these ids.

Both sides: sigmoid loss, beta 0.1, the reference a frozen copy of the starting weights (TRL: ``ref_model`` a copy;
ours: ``build_reference``'s frozen model, not LoRA and not precomputed), micro-batches of ``--micro-batch-size``
pairs padded to their longest answer, ``--global-batch-size`` pairs a step, AdamW, clip 1.0, constant LR.
Ours runs the real job (``engine.train.entry``) on the pairs written as MindSpeed's pairwise dataset; TRL runs
``DPOTrainer.train``. The pairs are one global batch, so every step (an epoch) trains the same pairs on both sides.
One warm-up step, then ``--repeats`` timed steps; tokens/s = real tokens of a step (prompt and answer of both sides
of every pair) / the fastest timed step. Each side runs in fresh processes, ``--pairs`` pairs of them (ours, TRL;
then TRL, ours; ...: ``bench/common/pairs.py``); the ratios are the median of the pairs' ratios, with min, max and
count. Peak memory = peak RSS minus RSS after imports (two models,
grads, Adam state, activations, logits). Prints one JSON line per process, then
``{"bench":"dpo_step","tokens_per_s_ratio":...,"peak_mem_ratio":...}``. Run: ``.venv/bin/python bench/dpo_step.py``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common.allocator import add_malloc_flag, apply_to_children  # noqa: E402
from bench.common.memory import peak_mb  # noqa: E402
from bench.common.pairs import add_step_pair_flags, alternate, speed_and_memory  # noqa: E402
from bench.common.qwen3 import SHAPE, SMOKE_SHAPE, write_side_models  # noqa: E402
from bench.common.seed_data import INTENTS, intent_question  # noqa: E402
from bench.common.seed_data import tokenizer_dir as _tokenizer_dir  # noqa: E402


def make_pairs(n: int, seed: int, max_turns: int = 12) -> list[dict[str, str]]:
    """Intent-classification preference pairs with ``bench/train_step.py``'s seed-like prompts (a list of skills,
    0-``max_turns`` turns of history, the last utterance): the right label chosen, another rejected."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt = intent_question(rng, max_turns)
        right = rng.randrange(len(INTENTS))
        wrong = (right + rng.randrange(1, len(INTENTS))) % len(INTENTS)
        pairs.append({"prompt": prompt, "chosen": INTENTS[right], "rejected": INTENTS[wrong]})
    return pairs


def tokenize(pairs: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    """TRL's tokenization of each pair: prompt ids (no special tokens), each answer's ids + the EOS token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tokenizer_dir())
    eos = tok.eos_token_id

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    return [
        {
            "prompt_ids": ids(p["prompt"]),
            "chosen_ids": [*ids(p["chosen"]), eos],
            "rejected_ids": [*ids(p["rejected"]), eos],
        }
        for p in pairs
    ]


def write_pairs(tokens: list[dict[str, list[int]]], prefix: Path) -> str:
    """The pairs as MindSpeed's pairwise dataset (prompt tokens masked from the labels)."""
    import numpy as np

    from engine.contract.indexed import PAIRWISE_FIELDS, IndexedDatasetWriter, instruction_prefix

    writers = {f: IndexedDatasetWriter(instruction_prefix(str(prefix), f)) for f in PAIRWISE_FIELDS}
    for t in tokens:
        for side in ("chosen", "rejected"):
            ids = np.asarray(t["prompt_ids"] + t[f"{side}_ids"])
            labels = ids.copy()
            labels[: len(t["prompt_ids"])] = -100
            writers[f"{side}_input_ids"].add_document(ids)
            writers[f"{side}_labels"].add_document(labels)
    for w in writers.values():
        w.finalize()
    return str(prefix)


def run_ours(work: Path, steps: int, mbs: int, gbs: int) -> list[float]:
    """Our job on the pairs: each iteration's time (ms, Megatron's iteration time) from its metrics."""
    from bench.common.trl import matched_spec
    from engine.contract.runfiles import RunDir
    from engine.contract.spec import parse_spec
    from engine.train import entry

    spec = {
        **matched_spec(steps),
        "stage": "dpo",
        "is_pairwise_dataset": True,
        "data_path": [str(work / "pairs")],
        "load": str(work / "model"),
        "micro_batch_size": mbs,
        "global_batch_size": gbs,
        "eval_iters": 0,
        "dpo_loss_type": "sigmoid",
        "dpo_beta": 0.1,
    }
    run = Path(tempfile.mkdtemp(prefix="run", dir=work))  # a fresh run directory for each process of each pair
    entry.run(parse_spec(spec), RunDir(run))
    rows = [json.loads(line)["metrics"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["iteration_time_ms"] / 1000 for r in rows]


def run_trl(
    work: Path, steps: int, mbs: int, gbs: int, tokens: list[dict[str, list[int]]], pairs: list[dict[str, str]]
) -> list[float]:
    """TRL's DPOTrainer on the same pairs and weights: each optimizer step's time (s), by a callback."""
    import copy

    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen3ForCausalLM
    from trl import DPOConfig, DPOTrainer

    from bench.common.trl import StepClock, matched_args

    model = Qwen3ForCausalLM.from_pretrained(work / "model", attn_implementation="eager")
    clock = StepClock()
    trainer = DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=DPOConfig(
            **matched_args(work, steps),
            per_device_train_batch_size=mbs,
            gradient_accumulation_steps=gbs // mbs,
            loss_type=["sigmoid"],
            beta=0.1,
            max_length=None,
            dataloader_drop_last=True,
        ),
        train_dataset=Dataset.from_dict({k: [p[k] for p in pairs] for k in ("prompt", "chosen", "rejected")}),
        processing_class=AutoTokenizer.from_pretrained(_tokenizer_dir()),
        callbacks=[clock],
    )
    theirs = trainer.train_dataset
    for k in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert theirs[k] == [t[k] for t in tokens], f"TRL tokenized {k} otherwise"
    trainer.train()
    return clock.times


def measure(side: str, work: str, steps: int, mbs: int, gbs: int, threads: int, tokens: list, pairs: list) -> dict:
    """In a fresh process: import both stacks, run, report."""
    from bench.common.trl import start_side

    rss0 = start_side(threads)
    if side == "ours":
        times = run_ours(Path(work) / "ours", steps, mbs, gbs)
    else:
        times = run_trl(Path(work) / "trl", steps, mbs, gbs, tokens, pairs)
    return {"side": side, "step_s": times, "peak_mem_mb": peak_mb() - rss0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-size", type=int, default=4, help="pairs per micro-batch")
    parser.add_argument("--global-batch-size", type=int, default=8, help="pairs per step")
    add_step_pair_flags(
        parser,
        rival="TRL",
        repeats=3,
        smoke="a one-layer hidden-64 model, 2 pairs with at most 2 turns of history, one timed step",
    )
    add_malloc_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.micro_batch_size, args.global_batch_size, args.pairs = 1, 1, 2, 1
    mbs, gbs, steps = args.micro_batch_size, args.global_batch_size, 1 + args.repeats
    # One global batch: every step (an epoch) trains the same pairs on both sides.
    pairs = make_pairs(gbs, args.seed, 2 if args.smoke else 12)
    tokens = tokenize(pairs)
    step_tokens = sum(2 * len(t["prompt_ids"]) + len(t["chosen_ids"]) + len(t["rejected_ids"]) for t in tokens)
    print(
        json.dumps(
            {
                "pairs": len(pairs),
                "tokens_per_step": step_tokens,
                "prompt_len_max": max(len(t["prompt_ids"]) for t in tokens),
            }
        )
    )
    apply_to_children(args.malloc)  # each side's process starts with it
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shape = SMOKE_SHAPE if args.smoke else SHAPE
        write_side_models(work, ("ours", "trl"), shape, args.seed, max_position_embeddings=40960)
        write_pairs(tokens, work / "ours" / "pairs")

        def run(side: str) -> dict:
            with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                return pool.submit(measure, side, tmp, steps, mbs, gbs, args.threads, tokens, pairs).result()

        rounds = alternate(run, ("ours", "trl"), args.pairs, log=lambda r: print(json.dumps(r)))
    # Every step trains the same pairs: tokens/s of a process's fastest timed step (the least disturbed on a shared
    # machine); the ratios are the median of the pairs' ratios.
    print(
        json.dumps(
            {
                "bench": "dpo_step",
                "smoke": args.smoke,
                **speed_and_memory(rounds, "trl", lambda r: step_tokens / min(r["step_s"][1:])),
                "micro_batch_size": mbs,
                "global_batch_size": gbs,
                "repeats": args.repeats,
                "threads": args.threads,
                "malloc": args.malloc,
            }
        )
    )


if __name__ == "__main__":
    main()
