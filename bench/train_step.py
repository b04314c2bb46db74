"""Training-step throughput and peak memory: this engine vs transformers eager Qwen3 + torch AdamW, same samples.

CPU, fp32, Qwen3 shape hidden 512 / 8 layers / 8 heads (4 KV groups, head dim 64) / FFN 1536 / the real 151,936
vocabulary (tied, as Qwen3-4B). SFT samples shaped like the seed's (004: "请你判读用户的意图…" intent prompts with a
variable interaction history, a short intent label as the answer, Qwen3 template with enable_thinking true,
seq_length 800), tokenized with the real Qwen3 tokenizer. Both sides: same initial weights, same global batches
(the seed's micro-batch 8, global batch 16), loss normalised by the global count of labelled tokens (HF: ``num_items_in_batch``),
gradient clipping 1.0, AdamW without weight decay.

Ours: padding-free packing (one row per micro-batch), chunked cross-entropy over labelled rows only.
HF: right-padded micro-batches (padded to the longest sample, as DataCollatorForSeq2Seq), full logits.

Each side runs in fresh processes, ``--pairs`` pairs of them (ours, HF; then HF, ours; ...:
``bench/common/pairs.py``), with one intra-op thread (``--threads``: with two threads, other load on a shared
machine makes each op wait for the slower thread, which varied our step time 5.9-28 s between runs), one
warm-up step, then ``--repeats`` timed steps on the same global batch;
tokens/s = real tokens of that batch (sample lengths, no padding) / the fastest repeat (on a shared machine the
least disturbed one); the ratios are the median over the pairs of each pair's ratio, with their min, max and count.
Peak memory = peak RSS minus RSS after imports (weights + grads + Adam state + activations).
Prints one JSON line per process, then ``{"bench":"train_step","tokens_per_s_ratio":...,"peak_mem_ratio":...}``.
Run: ``.venv/bin/python bench/train_step.py`` (about 9 minutes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common.memory import peak_mb, rss_mb  # noqa: E402
from bench.common.pairs import add_step_pair_flags, alternate, speed_and_memory  # noqa: E402
from bench.common.qwen3 import SHAPE, SMOKE_SHAPE  # noqa: E402
from bench.common.seed_data import INTENTS, intent_question, tokenizer_dir  # noqa: E402

SEQ_LENGTH = 800


def make_samples(n: int, seed: int, max_turns: int = 12) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of ``n`` seed-like intent-classification conversations (0-``max_turns`` turns of
    history)."""
    from engine.data.templates import encode_conversations
    from engine.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir())
    rng = random.Random(seed)
    conversations = []
    for _ in range(n):
        user = intent_question(rng, max_turns)
        conversations.append(
            [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": user},
                {"role": "assistant", "content": rng.choice(INTENTS)},
            ]
        )
    encoded = encode_conversations(tok, conversations, "qwen3", "true")
    return [(ids[:SEQ_LENGTH].tolist(), labels[:SEQ_LENGTH].tolist()) for ids, labels in encoded]


def _config(shape: dict):
    from engine.contract.model_config import ModelConfig

    return ModelConfig.from_hf(shape)  # Qwen3's defaults (RoPE theta 1e6, RMSNorm eps 1e-6, 40,960 positions)


class OursSide:
    """Our engine: packed micro-batches through ``engine.train.loop.train_step`` (chunked loss, token-normalised)."""

    name = "ours"

    def __init__(self, seed: int, shape: dict):
        import torch
        import torch.distributed as dist

        from engine.model.qwen3 import Qwen3Model
        from engine.train.loop import TrainState
        from engine.train.optim import LossScaler
        from engine.train.schedule import LRSchedule, Scheduler
        from engine.train.step_runner import ModuleRunner, lm_loss

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.model = Qwen3Model(_config(shape))
        self.model.init_weights(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.0, foreach=True)
        self.scheduler = Scheduler(self.optimizer, LRSchedule(1e-4, 1e-4, "constant", 10**6))
        self.scaler = LossScaler(
            argparse.Namespace(
                fp16=False,
                loss_scale=None,
                initial_loss_scale=1.0,
                min_loss_scale=1.0,
                loss_scale_window=1000,
                hysteresis=2,
            )
        )
        self.state = TrainState()
        self.runner = ModuleRunner(self.model, torch.device("cpu"), None, lm_loss(False, chunk_size=1024))

    def step(self, chunk: list, mbs: int) -> float:
        import numpy as np

        from engine.train.batches import Sample, pack
        from engine.train.loop import train_step

        batches = [
            pack([Sample(np.asarray(i), np.asarray(lab)) for i, lab in chunk[m : m + mbs]], SEQ_LENGTH)
            for m in range(0, len(chunk), mbs)
        ]
        rec = train_step(
            self.runner,
            self.optimizer,
            self.scheduler,
            self.scaler,
            batches,
            self.state,
            global_batch_size=len(chunk),
            clip_grad=1.0,
        )
        return float(rec.loss_sum / rec.counts[0])


class HFSide:
    """transformers eager Qwen3ForCausalLM + torch AdamW on right-padded micro-batches (same weights)."""

    name = "hf_eager"

    def __init__(self, seed: int, shape: dict):
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        from engine.model.hf_mapping import hf_from_native
        from engine.model.qwen3 import Qwen3Model

        cfg = _config(shape)
        native = Qwen3Model(cfg)
        native.init_weights(seed)
        weights = dict(native.state_dict())
        hf_state = dict(hf_from_native(weights.__getitem__, cfg))
        del native, weights
        self.model = Qwen3ForCausalLM(Qwen3Config(**cfg.to_hf("float32"), attn_implementation="eager"))
        self.model.load_state_dict(hf_state, strict=False)  # lm_head is tied to embed_tokens
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.0, foreach=True)

    def step(self, chunk: list, mbs: int) -> float:
        import torch

        items = sum(sum(1 for t in labels[1:] if t != -100) for _, labels in chunk)  # labelled tokens after the shift
        total = 0.0
        for m in range(0, len(chunk), mbs):
            part = chunk[m : m + mbs]
            width = max(len(i) for i, _ in part)
            ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in part])
            labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in part])
            mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in part])
            out = self.model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=items)
            out.loss.backward()
            total += float(out.loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


SIDES = {"ours": OursSide, "hf": HFSide}


def measure(side: str, batches: list[list], mbs: int, seed: int, threads: int, shape: dict) -> dict[str, Any]:
    """In a fresh process: build ``side``, run one warm-up step, then time each of ``batches`` (one step each).

    Peak memory = peak RSS growth over the RSS after imports (weights, grads, Adam state, activations). Both sides
    import torch and transformers first, so neither pays for the other's imports.
    """
    import torch
    import transformers  # noqa: F401

    torch.set_num_threads(threads)
    rss0 = rss_mb()
    model = SIDES[side](seed, shape)
    losses = [model.step(batches[0], mbs)]  # warm-up: allocations, Adam state creation
    times = []
    for chunk in batches[1:]:
        start = time.perf_counter()
        losses.append(model.step(chunk, mbs))
        times.append(time.perf_counter() - start)
    return {"side": side, "step_s": times, "losses": losses, "peak_mem_mb": peak_mb() - rss0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=16)
    add_step_pair_flags(
        parser,
        rival="HF",
        repeats=3,
        smoke="a one-layer hidden-64 model, batch 2 with at most 2 turns of history, one timed step",
    )
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.micro_batch_size, args.global_batch_size, args.pairs = 1, 1, 2, 1
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    samples = make_samples(2 * gbs, args.seed, 2 if args.smoke else 12)
    warmup, timed = samples[:gbs], samples[gbs:]
    lengths = sorted(len(i) for i, _ in samples)
    tokens = sum(len(i) for i, _ in timed)
    print(
        json.dumps(
            {
                "samples": len(samples),
                "min_len": lengths[0],
                "median_len": lengths[len(lengths) // 2],
                "max_len": lengths[-1],
                "tokens_per_step": tokens,
                "labelled_per_sample": sum(sum(t != -100 for t in lab) for _, lab in samples) / len(samples),
            }
        )
    )
    ctx = multiprocessing.get_context("spawn")

    def run(side: str) -> dict[str, Any]:
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            shape = SMOKE_SHAPE if args.smoke else SHAPE
            batches = [warmup] + [timed] * args.repeats
            return pool.submit(measure, side, batches, mbs, args.seed, args.threads, shape).result()

    rounds = alternate(run, ("ours", "hf"), args.pairs, log=lambda r: print(json.dumps(r)))
    # Per process the fastest repeat of the same batch (the least disturbed); across pairs the median pairwise ratio.
    print(
        json.dumps(
            {
                "bench": "train_step",
                "smoke": args.smoke,
                **speed_and_memory(rounds, "hf", lambda r: tokens / min(r["step_s"])),
                "first_loss_ours": round(rounds[0]["ours"]["losses"][0], 5),
                "first_loss_hf": round(rounds[0]["hf"]["losses"][0], 5),
                "micro_batch_size": mbs,
                "global_batch_size": gbs,
                "repeats": args.repeats,
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
