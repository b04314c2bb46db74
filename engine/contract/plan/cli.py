"""``python -m engine plan --spec spec.json`` or ``python -m engine plan [torchrun ARGS script.py] <MindSpeed flags>``.

Prints one row per rank (MiB) and ends with one JSON line ``{"ranks": [{"rank": 0, "total_bytes": ...}, ...], ...}``.
Own options: ``--model PRESET`` (shape of a published Qwen3 when neither ``load`` nor the flags give it),
``--device-memory-gib N`` (say whether every rank fits), ``--device-type npu`` (its attention kernel),
``--data-root DIR`` (where relative paths start, as the API resolves them: the team's area),
``--kind train|eval`` (default: from the script name, else
train), ``--suggest`` (training: the context/tensor-parallel and recompute layouts of the same world that fit
``--device-memory-gib``, best first; ``engine.contract.plan.suggest``). A MindSpeed line may start with torchrun's own arguments: ``--nproc_per_node``/``--nnodes`` give the world
size, the rest of torchrun's arguments are dropped. Fields a plan does not need (data paths, iterations, lr) may be
left out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from engine.contract.guard import WRITE_ENV
from engine.contract.plan.memory import MIB, Layout, RankMemory
from engine.contract.plan.planner import MemoryPlan, node_host_bytes, plan_spec
from engine.contract.plan.suggest import candidates, suggestion_table
from engine.contract.spec import EvalSpec, ModelSpec, ServeSpec, TrainSpec, first_error

_TORCHRUN_VALUE_FLAGS = {
    "--nproc_per_node",
    "--nproc-per-node",
    "--nnodes",
    "--node_rank",
    "--node-rank",
    "--master_addr",
    "--master-addr",
    "--master_port",
    "--master-port",
    "--rdzv_backend",
    "--rdzv-backend",
    "--rdzv_endpoint",
    "--rdzv-endpoint",
    "--rdzv_id",
    "--rdzv-id",
}
_PLACEHOLDERS: dict[str, dict[str, Any]] = {
    "train": {"data_path": ["unused-by-plan"], "train_iters": 1, "lr": 0.0},
    "eval": {"load": "unused-by-plan", "eval_data_path": "unused-by-plan"},
}


def split_torchrun(argv: list[str]) -> tuple[list[str], dict[str, Any], str | None]:
    """(engine flags, resources from torchrun's arguments, script name) of a pasted MindSpeed command line."""
    tokens = [t for t in argv if t not in ("torchrun", "\\")]
    script_at = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    launcher, flags = (tokens[:script_at], tokens[script_at + 1 :]) if script_at is not None else ([], tokens)
    resources: dict[str, Any] = {}
    rest: list[str] = []
    for source, keep in ((launcher, False), (flags, True)):
        i = 0
        while i < len(source):
            tok, value = source[i], None
            name = tok.split("=", 1)[0]
            if name in _TORCHRUN_VALUE_FLAGS:
                value = tok.split("=", 1)[1] if "=" in tok else source[i + 1]
                i += 1 if "=" in tok else 2
                if name in ("--nproc_per_node", "--nproc-per-node"):
                    resources["nproc_per_node"] = int(value)
                elif name == "--nnodes":
                    resources["nnodes"] = int(value.split(":")[-1])
                continue
            if keep:
                rest.append(tok)
            i += 1
    return rest, resources, tokens[script_at] if script_at is not None else None


def own_parser(prog: str) -> argparse.ArgumentParser:
    """The options ``plan`` and ``trace`` share; ``-h`` is answered by the caller with its module docstring."""
    own = argparse.ArgumentParser(prog=prog, add_help=False)
    own.add_argument("--model", help="model preset (qwen3-0.6b … qwen3-32b) when load/flags do not give the shape")
    own.add_argument("--device-memory-gib", type=float, help="memory of one device, to say whether every rank fits")
    own.add_argument("-h", "--help", action="store_true")
    return own


def parse_command(
    own: argparse.ArgumentParser, argv: list[str]
) -> tuple[argparse.Namespace, list[str], dict[str, Any], str | None]:
    """(own options, engine flags, resources, script name): ``own``'s options may stand anywhere on a pasted
    MindSpeed line; what they leave is split by ``split_torchrun``."""
    opts, rest = own.parse_known_args(argv)
    return (opts, *split_torchrun(rest))


def _spec_from_args(kind: str, flags: list[str], resources: dict[str, Any], data_root: str | None = None) -> ModelSpec:
    from engine.contract.flags import build_parser
    from engine.contract.spec import parse_spec

    ns = build_parser(kind).parse_args(flags)
    data: dict[str, Any] = {}
    if ns._spec and len(ns._spec) == 1 and ns._spec[0].endswith(".json"):
        data = json.loads(Path(ns._spec[0]).read_text())
    for key, value in vars(ns).items():
        if value is not None and not key.startswith("_"):
            data[key] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if resources:
        data.setdefault("resources", {}).update(resources)
    data["kind"] = data.get("kind", kind)
    for key, value in _PLACEHOLDERS.get(data["kind"], {}).items():
        data.setdefault(key, value)
    # Relative paths start at the team area, as the API resolves them; "/" as a second root keeps any absolute path
    # of the user's own machine valid (a plan reads checkpoints' config.json, never writes).
    roots = None if data_root is None else [str(Path(data_root).resolve()), "/"]
    spec = parse_spec(data, data_roots=roots)
    if isinstance(spec, TrainSpec | EvalSpec | ServeSpec):
        return spec
    raise ValueError(f"kind: only train, eval and serve jobs have a memory plan, not {data['kind']!r}")


def default_data_root() -> str | None:
    """The area relative paths start at: the first of the job's areas when a worker set them, else None (cwd)."""
    areas = [p for p in os.environ.get(WRITE_ENV, "").split(os.pathsep) if p]
    return areas[0] if areas else None


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f}"


HEAD = ("rank", "tp", "pp", "dp", "layers", "params", "main", "grads", "optim", "activ (mb)", "loss", "comm",
        "opt step", "total MiB", "host MiB", "h<->d MiB/step")  # fmt: skip


def _batch(lay: Layout) -> str:
    """The header's batch, in the spec's words: a serve job's max_num_seqs, else the micro-batches."""
    if lay.max_num_seqs is not None:
        return f"max_num_seqs {lay.max_num_seqs}"
    return f"MBS {lay.micro_batch_size} × {lay.micro_batches} micro-batches"


def _rows(ranks: list[RankMemory], cp: int = 1) -> list[str]:
    """The table: one row per rank (its CP rank in a column of its own under context parallelism)."""
    head = list(HEAD) if cp == 1 else [*HEAD[:4], "cp", *HEAD[4:]]
    rows = [head]
    for r in ranks:
        layers = f"{r.layers[0]}-{r.layers[-1]}" if r.layers else "-"
        parts = (r.params, r.main_params, r.grads, r.optimizer)
        at = [str(r.rank), str(r.tp_rank), str(r.pp_rank), str(r.dp_rank)] + ([str(r.cp_rank)] if cp > 1 else [])
        rows.append(
            [*at, layers, *map(_mib, parts)]
            + [f"{_mib(r.activations)} ({r.micro_batches_in_flight})", _mib(r.loss), _mib(r.comm)]
            + [_mib(r.optimizer_step), _mib(r.total_bytes), _mib(r.host), _mib(r.host_traffic)]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]


def _verdict(name: str, worst: RankMemory, device: int) -> str:
    fits = "fits" if worst.total_bytes <= device else "DOES NOT FIT"
    return f"{name}: worst rank {worst.rank} {_mib(worst.total_bytes)} MiB — {fits}"


def table(plan: MemoryPlan) -> str:
    """The per-rank plan at the worst case and, when the job's data was read, on it; the verdict per device."""
    cfg, lay = plan.cfg, plan.layout
    cp = f" CP {lay.dims.cp}" if lay.dims.cp > 1 else ""
    header = (
        f"model ({plan.source}): {cfg.num_layers} layers, hidden {cfg.hidden_size}, ffn "
        f"{cfg.ffn_hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_query_groups}, vocab "
        f"{cfg.vocab_size}; TP {lay.dims.tp} PP {lay.dims.pp} DP {lay.dims.dp}{cp}, {_batch(lay)}, seq {lay.seq_length}, "
        f"{'bf16/fp16' if lay.compute_bytes == 2 else 'fp32'}"
        f"{', LoRA r=' + str(lay.lora_r) if lay.lora_r else ''}"
    )
    lines = [header]
    if plan.data_ranks is not None and plan.data is not None:
        lines.append(f"worst_case (every micro-batch at seq_length {lay.seq_length}):")
    lines += _rows(plan.ranks, lay.dims.cp)
    if plan.data_ranks is not None and plan.data is not None:
        lines.append(f"this_data (its largest micro-batch: {plan.data.describe()}):")
        lines += _rows(plan.data_ranks, lay.dims.cp)
    device = plan.device_memory_bytes
    if device:
        verdicts = [_verdict("worst_case", plan.peak, device)]
        if plan.data_peak is not None:
            verdicts.append(_verdict("this_data (decides)", plan.data_peak, device))
        lines.append(f"device memory {_mib(device)} MiB: " + "; ".join(verdicts))
    host = node_host_bytes(plan.ranks, plan.layout)
    if host:
        limit = plan.host_memory_bytes
        verdict = "" if not limit else f" of {_mib(limit)} MiB — " + ("fits" if host <= limit else "DOES NOT FIT")
        lines.append(f"host memory per node (offloaded optimizer state): {_mib(host)} MiB{verdict}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    own = own_parser("python -m engine plan")
    own.add_argument("--host-memory-gib", type=float, help="memory of one host, to say whether offloaded state fits")
    own.add_argument("--kind", choices=("train", "eval"))
    own.add_argument("--device-type", choices=("cpu", "cuda", "npu"), help="resources.device_type (attention kernel)")
    own.add_argument(
        "--data-root",
        default=default_data_root(),
        help="directory relative paths start at, as the API resolves them: your team's area, e.g. "
        "var/data/teams/default under make run (default: $LLMJOBS_DATA_AREAS' first entry, else the current directory)",
    )
    own.add_argument(
        "--suggest",
        action="store_true",
        help="train: also list the CP × TP × recompute layouts of this world that fit --device-memory-gib, best first",
    )
    opts, flags, resources, script = parse_command(own, argv)
    if opts.help:
        print(__doc__)
        return 0
    if opts.device_type:
        resources["device_type"] = opts.device_type
    kind = opts.kind or ("eval" if script and "inference" in script else "train")
    try:
        spec = _spec_from_args(kind, flags, resources, opts.data_root)
        device = int(opts.device_memory_gib * 2**30) if opts.device_memory_gib else None
        plan = plan_spec(spec, opts.model, device)
        plan.host_memory_bytes = int(opts.host_memory_gib * 2**30) if opts.host_memory_gib else None
    except ValidationError as err:
        print(f"error: {first_error(err, 'spec')}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(plan))
    if not opts.suggest:
        print(json.dumps(plan.as_json()))
        return 0
    if not isinstance(spec, TrainSpec) or device is None:
        print("error: --suggest needs a training job and --device-memory-gib", file=sys.stderr)
        return 2
    found = candidates(spec, opts.model, device)
    print(suggestion_table(found, device))
    print(json.dumps({**plan.as_json(), "suggestions": [c.as_json() for c in found if c.fits]}))
    return 0
