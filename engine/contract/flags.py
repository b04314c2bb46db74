"""MindSpeed-style command lines -> job specs.

The parser is generated from the spec classes, so every spec field is a flag (``field_name`` -> ``--field-name``) and
the command line and the API can never drift apart. Flags MindSpeed has but that mean nothing here are accepted and
reported as ignored; any other unknown flag is an error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.contract.spec import SPEC_CLASSES, JobBase, parse_spec

log = logging.getLogger(__name__)

# MindSpeed/Megatron flags with no effect in this engine, with the number of values each takes.
# Fusions and kernels are chosen by the device layer; launcher settings come from ``resources``.
IGNORED_FLAGS: dict[str, int | str] = {
    "use-flash-attn": 0,
    "use-fused-rotary-pos-emb": 0,
    "use-fused-swiglu": 0,
    "use-fused-rmsnorm": 0,
    "use-fused-ring-attention-update": 0,
    "no-masked-softmax-fusion": 0,
    "no-gradient-accumulation-fusion": 0,
    "no-bias-swiglu-fusion": 0,
    "no-rope-fusion": 0,
    "no-shared-storage": 0,
    "overlap-grad-reduce": 0,
    "overlap-param-gather": 0,
    "use-distributed-optimizer-fusion": 0,
    "distributed-backend": 1,
    "transformer-impl": 1,
    "reuse-fp32-param": 0,
    "use-cpu-initialization": 0,
    "sequence-parallel-ignored": 0,
    # Training (engine.train): the loss is always normalised per token over the global batch, throughput and
    # memory are always logged, checkpoints are DCP while training and the legacy torch layout at the end.
    "calculate-per-token-loss": 0,
    "log-throughput": 0,
    "log-timers-to-tensorboard": 0,
    "log-memory-to-tensorboard": 0,
    "log-validation-ppl-to-tensorboard": 0,
    "no-check-for-nan-in-loss-and-grad": 0,
    "ckpt-format": 1,
    # MoE: token permutation is always one sort on the device; these choose MindSpeed's fused/async variants of it.
    "moe-permute-fusion": 0,
    "moe-permutation-async-comm": 0,
    "use-fused-moe-token-permute-and-unpermute": 0,
}
# MindSpeed-LLM's ``--stage simpo`` flags, with its defaults: here SimPO is stage dpo with dpo_loss_type simpo, its
# beta is dpo_beta and its margin simpo_gamma = gamma_beta_ratio × beta (MindSpeed subtracts the ratio before scaling).
SIMPO_FLAGS: dict[str, float | str] = {
    "simpo-beta": 2.5,
    "gamma-beta-ratio": 1.4,
    "simpo-loss-type": "sigmoid",
    "simpo-label-smoothing": 0.0,
}
# Fields that only exist in the JSON spec, never as flags (nested objects).
_NOT_FLAGS = {"resources", "metadata", "kind", "steps"}


def _unwrap(annotation: object) -> tuple[Any, bool]:  # Any: a type form (a class, Literal[...], ...)
    """(inner type, is_list) of a field annotation, looking through Optional/Annotated."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else (str, False)
    if origin is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def build_parser(kind: str) -> argparse.ArgumentParser:
    cls = SPEC_CLASSES[kind]
    parser = argparse.ArgumentParser(
        prog=f"python -m engine {kind}",
        description=(cls.__doc__ or "").strip().splitlines()[0],
        allow_abbrev=False,
    )
    # ``--spec`` is both ours (one JSON file) and MindSpeed's layer spec (``module.path name``, ignored here).
    parser.add_argument(
        "--spec", dest="_spec", nargs="+", metavar="SPEC_JSON", help="job spec file; flags override its fields"
    )
    parser.add_argument(
        "--run-dir",
        dest="_run_dir",
        help="where run files go (default: a new runs/<kind>-<time> below the current directory, never the directory itself)",
    )
    parser.add_argument("--nproc-per-node", dest="_nproc", type=int, help="resources.nproc_per_node (launcher hint)")
    for name, field in cls.model_fields.items():
        if name in _NOT_FLAGS:
            continue
        flag = "--" + name.replace("_", "-")
        inner, is_list = _unwrap(field.annotation)
        help_text = field.description or ""
        if inner is bool and not is_list:
            parser.add_argument(flag, dest=name, action="store_true", default=None, help=help_text)
        elif is_list:
            parser.add_argument(flag, dest=name, nargs="+", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text)
    if kind == "train":  # MindSpeed's SimPO stage, translated by ``_simpo_stage``
        for flag in SIMPO_FLAGS:
            parser.add_argument(f"--{flag}", dest="_simpo_" + flag.replace("-", "_"), default=None)
    for flag, nargs in IGNORED_FLAGS.items():
        if flag.replace("-", "_") in cls.model_fields:
            continue
        kwargs: dict[str, Any] = {"action": "store_true"} if nargs == 0 else {"nargs": nargs}
        parser.add_argument("--" + flag, dest="_ignored_" + flag.replace("-", "_"), default=None, **kwargs)
    return parser


def _resources_from_torchrun(data: dict[str, Any]) -> None:
    """Under torchrun the job's size is the launcher's: without explicit resources, take WORLD_SIZE and
    LOCAL_WORLD_SIZE so the spec's layout checks (TP × PP divides the world) see the real world size."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    resources = data.setdefault("resources", {})
    if world > 1 and "nproc_per_node" not in resources and "nnodes" not in resources:
        local = local if local and world % local == 0 else world
        resources.update(nproc_per_node=local, nnodes=world // local)


def spec_from_argv(kind: str, argv: Sequence[str]) -> tuple[JobBase, Path, list[str]]:
    """Parse a command line into (spec, run_dir, ignored flags). Raises SystemExit(2) on an unknown flag."""
    parser = build_parser(kind)
    ns = parser.parse_args(list(argv))
    data: dict[str, Any] = {}
    ignored = []
    spec_file = (
        ns._spec[0]
        if ns._spec and len(ns._spec) == 1 and (ns._spec[0].endswith(".json") or Path(ns._spec[0]).is_file())
        else None
    )
    if ns._spec and spec_file is None:
        ignored.append("--spec " + " ".join(ns._spec))
    if spec_file:
        data = json.loads(Path(spec_file).read_text())
        if data.get("kind", kind) != kind:
            parser.error(f"--spec: file is a {data['kind']!r} spec, not {kind!r}")
    data["kind"] = kind
    for key, value in vars(ns).items():
        if value is None:
            continue
        if key.startswith("_ignored_"):
            ignored.append("--" + key[len("_ignored_") :].replace("_", "-"))
        elif not key.startswith("_"):
            # One list value like "4,4" is split by the spec's own validator; several stay a list.
            data[key] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if kind == "train":
        _simpo_stage(parser, ns, data)
    if ns._nproc:
        data.setdefault("resources", {})["nproc_per_node"] = ns._nproc
    _resources_from_torchrun(data)
    if ignored:
        log.warning("ignored flags (no effect in this engine): %s", " ".join(ignored))
    return parse_spec(data), Path(ns._run_dir) if ns._run_dir else default_run_dir(kind), ignored


def _simpo_stage(parser: argparse.ArgumentParser, ns: argparse.Namespace, data: dict[str, Any]) -> None:
    """MindSpeed's ``--stage simpo`` line as this engine's stage dpo with dpo_loss_type simpo (same loss: its
    sigmoid SimPO with margin gamma_beta_ratio × beta); its flags without that stage are an error, not ignored."""
    given = {f: getattr(ns, "_simpo_" + f.replace("-", "_")) for f in SIMPO_FLAGS}
    if data.get("stage") != "simpo":
        if any(v is not None for v in given.values()):
            parser.error(f"--{next(f for f, v in given.items() if v is not None)}: applies to --stage simpo only")
        return
    value = {f: given[f] if given[f] is not None else default for f, default in SIMPO_FLAGS.items()}
    if value["simpo-loss-type"] != "sigmoid":
        parser.error(f"--simpo-loss-type: only sigmoid is supported, not {value['simpo-loss-type']!r}")
    try:
        beta, ratio, smoothing = (
            float(str(value[f])) for f in ("simpo-beta", "gamma-beta-ratio", "simpo-label-smoothing")
        )
    except ValueError as err:
        parser.error(f"--simpo-beta/--gamma-beta-ratio/--simpo-label-smoothing: {err}")
    if smoothing:
        parser.error("--simpo-label-smoothing: only 0 is supported")
    data.update(stage="dpo", dpo_loss_type="simpo", dpo_beta=beta, simpo_gamma=ratio * beta)


def default_run_dir(kind: str) -> Path:
    """``runs/<kind>-<stamp>``: a fresh directory per run, so events.jsonl, result.json and logs/ never land among the
    user's files nor append to an earlier run's. Every rank of one torchrun gets the same one (its rendezvous id and
    port are shared); a single process takes the time and its pid."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        stamp = f"torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-{os.environ.get('MASTER_PORT', '0')}"
    else:
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return Path("runs") / f"{kind}-{stamp}"
