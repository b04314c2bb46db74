"""The ``eval`` job kind: ``python -m engine eval`` (the seed's ``inference_4_midea_test.py``).

``eval_mode=generate`` (default): render every test line's prompt with the training template, decode answers in
left-padded batches with a KV cache, score them by exact match against the reference assistant turn, and write
``predictions.jsonl`` (one object per scored line: ``line``, ``input``, ``reference``, ``output`` raw, ``answer``
parsed, ``correct``, ``finish_reason``) next to the summary in ``result.json``.
``eval_mode=loss``: token loss and perplexity with the training loss code (``engine.eval.loss_eval``).

Under torchrun with several ranks the test set is split across data-parallel ranks and rank 0 gathers, scores and
writes. ``tensor_model_parallel_size`` > 1 shards the generate-mode model with the trainer's TP plan
(``engine.parallel.tensor_parallel``) over the ``tp`` dim of a dp×tp mesh; the vocab-parallel head's logits are
all-gathered, so greedy outputs equal a one-process run. Pipeline-parallel decoding is not implemented (nor TP in
loss mode): such a layout is reported and the model is replicated instead, PP ranks acting as data-parallel ranks.

With ``deployment_url`` (a ``serve`` job's engine; the worker sets it from ``deployment``) no model is loaded: one
process renders the prompts the same way and generates them through the deployment (``engine.eval.remote``), then
scores and reports exactly as above.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from engine.contract.layout import LayoutError
from engine.contract.model_config import ModelConfig
from engine.contract.runfiles import BadInput, RunDir
from engine.contract.spec import EvalSpec
from engine.eval.dataset import TestLine, TestSet, read_test_set
from engine.eval.generate import DecodeOptions, generate
from engine.eval.loss_eval import gather_objects, run_loss_eval
from engine.eval.remote import RemoteOptions, generate_remote
from engine.eval.scoring import Scoreboard
from engine.load.inference import build_model
from engine.load.tokenizer import spec_tokenizer, stop_ids
from engine.model.sampling import SamplingParams
from engine.parallel.device import Device, init_distributed
from engine.parallel.mesh import ParallelDims, build_mesh

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

PREDICTIONS = "predictions.jsonl"
MAX_REPORTED_BAD_LINES = 50


def _decode_options(spec: EvalSpec, tokenizer: PreTrainedTokenizerBase, tp_size: int) -> DecodeOptions:
    stops = stop_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    temperature = 0.0 if spec.greedy else spec.temperature
    sampling = SamplingParams(temperature=temperature, top_k=spec.top_k, top_p=spec.top_p, seed=spec.seed)
    return DecodeOptions(
        max_new_tokens=spec.max_new_tokens,
        stop_ids=tuple(sorted(stops)),
        pad_id=pad,
        sampling=sampling,
        use_cache=not spec.no_kv_cache,
        tp_size=tp_size,
    )


def _report_bad_lines(run: RunDir, testset: TestSet, policy: str) -> None:
    for bad in testset.bad[:MAX_REPORTED_BAD_LINES]:
        run.event(
            "warning",
            f"{testset.path}: line {bad.number} skipped: {bad.reason}",
            line=bad.number,
            reason=bad.reason,
            policy=policy,
        )
    if testset.bad:
        log.warning("%d bad test line(s) skipped (bad_line_policy=%s)", len(testset.bad), policy)


def _decode(
    model: torch.nn.Module,
    cfg: ModelConfig,
    lines: list[TestLine],
    opts: DecodeOptions,
    batch_size: int,
    run: RunDir,
    device: Device,
    total: int,
    world: int,
) -> tuple[list[dict[str, Any]], int, float]:
    """Generate for this rank's lines: (records, tokens generated, seconds). Progress counts lines of all ranks,
    estimated from this rank's share (rank 0 writes the events; every DP rank holds about ``total / world``)."""
    prompts = [line.prompt_ids for line in lines]
    records: list[dict[str, Any]] = []
    produced, start, done = 0, time.perf_counter(), 0
    for step, (indices, gen) in enumerate(generate(model, cfg, prompts, opts, batch_size)):
        device.synchronize()
        produced += gen.num_generated
        for i, tokens, reason in zip(indices, gen.tokens, gen.finish_reasons, strict=True):
            records.append({"index": i, "tokens": tokens, "finish_reason": reason})
        done += len(indices)
        elapsed = time.perf_counter() - start
        run.metric(
            step,
            {
                "tokens_per_s": produced / max(elapsed, 1e-9),
                "batch_size": len(indices),
                "batch_tokens_per_s": gen.num_generated / max(gen.seconds, 1e-9),
            },
        )
        run.progress(min(done * world, total), total, "lines")
    return records, produced, time.perf_counter() - start


def _write_predictions(run: RunDir, rows: list[dict[str, Any]]) -> Path:
    target = run.path / PREDICTIONS
    tmp = target.with_name(f".{PREDICTIONS}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    os.replace(tmp, target)
    return target


def _score(
    spec: EvalSpec, tokenizer: PreTrainedTokenizerBase, lines: list[TestLine], records: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], Scoreboard]:
    board = Scoreboard(spec.answer_normalization, top_confusions=spec.top_confusions)
    rows = []
    for rec in sorted(records, key=lambda r: lines[r["index"]].number):
        line = lines[rec["index"]]
        output = tokenizer.decode(rec["tokens"], skip_special_tokens=False)
        assert isinstance(output, str)  # one sequence in, one text out
        answer, correct = board.add(output, line.reference)
        rows.append(
            {
                "line": line.number,
                "input": line.input,
                "reference": line.reference,
                "output": output,
                "answer": answer,
                "correct": correct,
                "finish_reason": rec["finish_reason"],
            }
        )
    return rows, board


def _check_layout(spec: EvalSpec, run: RunDir) -> None:
    """Report the layouts eval replicates instead of sharding: PP always, TP in loss mode."""
    tp, pp = spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size
    if pp > 1 or (tp > 1 and spec.eval_mode == "loss"):
        field = "pipeline_model_parallel_size" if pp > 1 else "tensor_model_parallel_size"
        message = (
            f"{field}: eval does not shard the model yet (TP {tp}, PP {pp} asked, eval_mode "
            f"{spec.eval_mode}); every rank holds the whole model and decodes its share of the test set"
        )
        log.warning(message)
        run.event("warning", message, field=field)


def _mesh(spec: EvalSpec, device: Device) -> tuple[DeviceMesh | None, int, int]:
    """(TP mesh or None, dp rank, dp size): the dp×tp mesh of a generate-mode run with TP > 1; the dp split is the
    test set's. PP ranks are not pipeline stages here (see ``_check_layout``): they count as data-parallel ranks."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp = spec.tensor_model_parallel_size
    if tp == 1 or spec.eval_mode == "loss":
        return None, rank, world
    try:
        dims = ParallelDims.from_world(world, tp=tp)
    except LayoutError as err:
        raise BadInput(str(err), field=err.field) from err
    mesh = build_mesh(device, dims)
    return mesh["tp"], mesh["dp"].get_local_rank(), mesh["dp"].size()


def _test_set(spec: EvalSpec, tokenizer: PreTrainedTokenizerBase, run: RunDir) -> TestSet:
    testset = read_test_set(
        spec.eval_data_path,
        tokenizer,
        template=(spec.prompt_type or "qwen3"),
        enable_thinking=spec.enable_thinking,
        map_keys=spec.map_keys,
        limit=spec.eval_data_size,
        max_prompt_tokens=spec.seq_length,
        policy=spec.bad_line_policy,
    )
    _report_bad_lines(run, testset, spec.bad_line_policy)
    if not testset.lines:
        raise BadInput(
            f"eval_data_path: no scorable line in {spec.eval_data_path} ({len(testset.bad)} bad line(s) skipped)",
            field="eval_data_path",
        )
    return testset


def _decode_remote(
    spec: EvalSpec, tokenizer: PreTrainedTokenizerBase, lines: list[TestLine], run: RunDir
) -> tuple[list[dict[str, Any]], int, float]:
    """The test set generated through ``deployment_url`` (``engine.eval.remote``): (records, tokens, seconds)."""
    opts = RemoteOptions.of_spec(spec, frozenset(stop_ids(tokenizer)))
    start, produced = time.perf_counter(), 0

    def done(i: int, record: dict[str, Any]) -> None:
        nonlocal produced
        produced += record["generated"]
        run.metric(i, {"tokens_per_s": produced / max(time.perf_counter() - start, 1e-9)})
        run.progress(i + 1, len(lines), "lines")

    concurrency = spec.eval_batch_size or spec.micro_batch_size
    if spec.deployment_url is None:
        raise BadInput("deployment: not resolved to a URL (the worker sets deployment_url)", field="deployment")
    records = generate_remote(spec.deployment_url, [line.prompt_ids for line in lines], opts, concurrency, done)
    return records, produced, time.perf_counter() - start


def run(spec: EvalSpec, run: RunDir) -> tuple[dict[str, str], dict[str, Any]]:
    """Entry point for ``python -m engine eval`` (see the module docstring)."""
    torch.manual_seed(spec.seed)
    tokenizer = spec_tokenizer(spec)
    if spec.remote:  # through a running deployment: no model here, one process
        testset = _test_set(spec, tokenizer, run)
        records, produced, seconds = _decode_remote(spec, tokenizer, testset.lines, run)
        served = {"deployment": spec.deployment, "deployment_url": spec.deployment_url}
        return _report(spec, run, tokenizer, testset, [(records, produced, seconds)], 1, served)
    _check_layout(spec, run)
    device = init_distributed(spec.resources.device_type)
    world = dist.get_world_size() if dist.is_initialized() else 1
    tp_mesh, dp_rank, dp_size = _mesh(spec, device)
    # built on meta and filled on the device: under TP each rank reads only its own pieces
    model, cfg, info = build_model(spec, vocab_hint=len(tokenizer), tp_mesh=tp_mesh, device=device.torch_device)
    if spec.eval_mode == "loss":
        return run_loss_eval(spec, run, model, tokenizer, device, info)
    testset = _test_set(spec, tokenizer, run)
    opts = _decode_options(spec, tokenizer, tp_size=world // dp_size)
    mine = testset.lines[dp_rank::dp_size]
    records, produced, seconds = _decode(
        model, cfg, mine, opts, spec.eval_batch_size or spec.micro_batch_size, run, device, len(testset.lines), dp_size
    )
    for rec in records:  # indices into this rank's share -> indices into the whole test set
        rec["index"] = rec["index"] * dp_size + dp_rank
    # Every TP rank of a DP group decoded the same lines: keep one copy per DP rank (the first of its TP group).
    gathered = gather_objects((records, produced, seconds))[:: world // dp_size]
    if world > 1:
        run.progress(len(testset.lines), len(testset.lines), "lines")  # every rank is done now
    described = {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, **info}
    return _report(spec, run, tokenizer, testset, gathered, world, described, world // dp_size)


def _report(
    spec: EvalSpec,
    run: RunDir,
    tokenizer: PreTrainedTokenizerBase,
    testset: TestSet,
    gathered: list[tuple[list[dict[str, Any]], int, float]],
    world: int,
    model: dict[str, Any],
    tp: int = 1,
) -> tuple[dict[str, str], dict[str, Any]]:
    """Score every rank's records, write the predictions (rank 0) and the run's summary."""
    all_records = [r for part in gathered for r in part[0]]
    rows, board = _score(spec, tokenizer, testset.lines, all_records)
    outputs: dict[str, str] = {}
    if run.is_writer:
        outputs["predictions"] = str(_write_predictions(run, rows))
        outputs["result"] = str(run.path / "result.json")
    tokens = sum(part[1] for part in gathered)
    wall = max(part[2] for part in gathered)
    temperature = 0.0 if spec.greedy else spec.temperature
    greedy = SamplingParams(temperature=temperature, top_k=spec.top_k, top_p=spec.top_p, seed=spec.seed).greedy
    summary = {
        **board.summary(),
        "skipped": len(testset.bad),
        "skipped_lines": [{"line": b.number, "reason": b.reason} for b in testset.bad[:MAX_REPORTED_BAD_LINES]],
        "bad_line_policy": spec.bad_line_policy,
        "stopped_by_length": sum(r["finish_reason"] == "length" for r in rows),
        "generated_tokens": tokens,
        "generation_seconds": wall,
        "tokens_per_s": tokens / max(wall, 1e-9),
        "decoding": {
            "greedy": greedy,
            "temperature": spec.temperature,
            "top_k": spec.top_k,
            "top_p": spec.top_p,
            "seed": spec.seed,
            "max_new_tokens": spec.max_new_tokens,
            "batch_size": spec.eval_batch_size or spec.micro_batch_size,
            "kv_cache": not spec.no_kv_cache or spec.remote,
        },
        "world_size": world,
        "tensor_model_parallel_size": tp,
        "model": model,
    }
    log.info(
        "accuracy %.4f (%d/%d), %d skipped, %.1f tokens/s",
        summary["accuracy"],
        summary["correct"],
        summary["total"],
        summary["skipped"],
        summary["tokens_per_s"],
    )
    return outputs, summary
