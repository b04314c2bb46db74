"""Entry point shared by every job kind: parse flags/spec, set up the run directory, run, report, exit.

Each kind's runner is ``run(spec, run: RunDir) -> (outputs, summary)``; it raises ``BadInput`` for user errors.
Multi-process runs end with ``os._exit`` after tearing down the process group: processes that used a DeviceMesh
otherwise abort at interpreter exit now and then (``docs/torch-distributed-on-gloo.md``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from engine.contract.guard import check_spec
from engine.contract.parent_death import die_with_launcher
from engine.contract.runfiles import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_RETRYABLE,
    BadInput,
    RunDir,
    is_disk_full,
    setup_logging,
)
from engine.train.preempt import REQUEUE_REQUEST, Preempted

log = logging.getLogger("engine")

RUNNERS: dict[str, str] = {
    "preprocess": "engine.preprocess:run",
    "train": "engine.train.entry:run",
    "convert": "engine.checkpoint.job:run",
    "eval": "engine.eval.job:run",
    "serve": "engine.serve.job:run",
}
USAGE = "usage: python -m engine {preprocess,convert,train,eval,serve,plan,trace} [--spec spec.json] [--run-dir DIR] [flags]"


def _runner(kind: str) -> Callable[..., tuple[dict[str, str], dict[str, Any]]]:
    module, func = RUNNERS[kind].split(":")
    return getattr(importlib.import_module(module), func)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _finish(code: int) -> int:
    """Tear down torch.distributed if a runner left it up, then leave without running atexit/destructors."""
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):  # exiting anyway
                dist.destroy_process_group()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plan":  # no run directory, no process group: prints and exits
        from engine.contract.plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv and argv[0] == "trace":  # fake tensors, fake process group: prints and exits
        from engine.trace.cli import main as trace_main

        return trace_main(argv[1:])
    if not argv or argv[0] not in RUNNERS:
        print(USAGE, file=sys.stderr)
        return EXIT_BAD_INPUT
    kind, rest = argv[0], argv[1:]
    die_with_launcher()  # first: a rank whose torchrun is gone must not train on
    from engine.contract.flags import spec_from_argv  # pydantic only; cheap

    try:
        spec, run_dir, ignored = spec_from_argv(kind, rest)
    except Exception as err:  # noqa: BLE001 - pydantic ValidationError or a bad spec file
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    setup_logging(run_dir, _rank())
    run = RunDir(run_dir, _rank())
    log.info("run files (events.jsonl, result.json, logs/) in %s", run_dir.resolve())
    if ignored:
        run.event("warning", "ignored flags: " + " ".join(ignored), ignored=ignored)
    run.event("started", f"{kind} started", kind=kind)
    try:
        check_spec(spec)  # the job's data areas, when a worker gave them (engine.contract.guard)
        if kind == "serve":  # a process-wide allocator setting: set by the serving process's entry, not by the
            # runner, which tests and benches also call inside processes that serve nothing (engine.serve.host_memory)
            from engine.serve.host_memory import keep_freed_memory

            keep_freed_memory()
        outputs, summary = _runner(kind)(spec, run)
    except BadInput as err:
        log.error("%s", err)
        run.event("error", str(err), code="bad_input", field=err.field)
        return _finish(EXIT_BAD_INPUT)
    except Preempted as err:  # Slurm's USR2: checkpoint saved, the job asks to be requeued
        log.warning("%s", err)
        run.event("warning", str(err), code="preempted", iteration=err.iteration)
        (run.path / REQUEUE_REQUEST).write_text(f"{err.iteration}\n")
        return _finish(EXIT_RETRYABLE)
    except Exception as err:  # noqa: BLE001 - report every crash the same way
        if is_disk_full(err):  # retryable once space returns; the previous checkpoint is intact
            log.error("%s: no space left: %s", kind, err)
            run.event("error", f"disk full: {err}", code="disk_full")
            return _finish(EXIT_RETRYABLE)
        log.error("%s failed:\n%s", kind, traceback.format_exc())
        run.event("error", f"{type(err).__name__}: {err}", code="engine_error")
        return _finish(EXIT_FAILED)
    run.write_result(kind, outputs, summary)
    run.event("finished", f"{kind} succeeded", outputs=outputs)
    return _finish(EXIT_OK)
