"""What every job kind shares: the path field types (checked against the caller's areas), the list and
tri-state field types, ``Resources``, ``JobBase`` and ``validate`` (a spec through an adapter with the path context)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationInfo,
    model_serializer,
)

from engine.contract.lora_targets import resolve_targets
from engine.contract.nofollow import links_below
from engine.contract.retention import metric_name


def _resolve_in_roots(value: str | None, info: ValidationInfo, *, output: bool = False) -> str | None:
    """Resolve ``value`` and refuse it unless it stays inside one of the context's data roots (the caller's areas;
    an input may also be inside ``read_roots``, the shared read-only areas). Relative paths start at the first root."""
    if value is None or not info.context or info.context.get("data_roots") is None:
        return value
    roots = [Path(r).resolve() for r in info.context["data_roots"]]
    readable = [] if output else [Path(r).resolve() for r in info.context.get("read_roots") or ()]
    if not roots:
        raise ValueError("no data roots are configured, so no path is allowed")
    raw = Path(value)
    if ".." in raw.parts:
        raise ValueError(f"path {value!r} must not contain '..'")
    candidate = raw if raw.is_absolute() else roots[0] / raw
    resolved = candidate.resolve()  # follows symlinks, so a link pointing outside is caught below
    if not within(resolved, [*roots, *readable]):
        where = ", ".join(map(str, roots)) + (f"; or, to read, {', '.join(map(str, readable))}" if readable else "")
        what = "an output" if output else "a path"
        raise ValueError(f"{what} {value!r} resolves outside your data area ({where})")
    if not output and resolved.is_dir():
        _refuse_links_out(value, resolved, [*roots, *readable])
    return str(resolved)


LINK_SCAN_ENTRIES = 100_000  # a submission looks at this many entries of an input folder; the engine at every one


def _refuse_links_out(value: str, folder: Path, areas: list[Path]) -> None:
    """An input folder (a checkpoint, a tokenizer) holding a link that leads out of the caller's areas is refused:
    the engine would read another team's files through it (``engine.contract.guard`` checks every entry again at run
    time, and reads adapters without following links)."""
    for link in links_below(folder, LINK_SCAN_ENTRIES):
        if not within(link.resolve(), areas):
            inside = link.relative_to(folder)
            raise ValueError(f"{value!r} holds {str(inside)!r}, a symbolic link leading outside your data area")


def within(path: Path, roots: list[Path]) -> bool:
    """Whether ``path`` (resolved) is one of ``roots`` or below one."""
    return any(path == r or r in path.parents for r in roots)


DataPath = Annotated[str, AfterValidator(_resolve_in_roots)]
"""A filesystem path a job reads; must resolve inside the caller's areas (or a shared read-only one) when submitted
over the API."""


def _resolve_output(value: str | None, info: ValidationInfo) -> str | None:
    return _resolve_in_roots(value, info, output=True)


def _output_below_root(value: str | None, info: ValidationInfo) -> str | None:
    """An output must name something inside a root, not the root: a prefix equal to the root ("", ".") would put
    ``<root>_text_document.bin`` beside it, outside every root."""
    if value is None or not info.context or info.context.get("data_roots") is None:
        return value
    if any(Path(value) == Path(r).resolve() for r in info.context["data_roots"]):
        raise ValueError(f"path {value!r} is your data area itself; name a file or directory inside it")
    return value


OutputPath = Annotated[str, AfterValidator(_resolve_output), AfterValidator(_output_below_root)]
"""A path a job writes: strictly below one of the caller's own areas (never a shared read-only one)."""


def _split_list(value: object) -> object:
    """Accept MindSpeed's comma/space separated strings ("4,4" or "a b") for list fields."""
    if isinstance(value, str):
        return [v for v in value.replace(",", " ").split() if v]
    return value


def _json_object(value: object) -> object:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"not valid JSON: {err.msg} at character {err.pos}") from err
    return value


def _tristate(value: object) -> object:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value).lower()


def _resolve_list_in_roots(values: list[str], info: ValidationInfo) -> list[str]:
    """Each path of a list inside the data roots; numbers pass (Megatron's blend "0.3 prefix1 0.7 prefix2")."""
    return [value if _is_number(value) else str(_resolve_in_roots(value, info)) for value in values]


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _layer_freq(value: object) -> object:
    """Megatron's ``--moe-layer-freq``: an int, or a 0/1 per layer as "[1,0,1]" / "1,0,1" / a list. Megatron's
    Python-expression form ("([1]*3+[0])*2") is refused: user input is never evaluated."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        parts = [p for p in text.replace(",", " ").split() if p]
        if not all(p.lstrip("-").isdigit() for p in parts) or not parts:
            raise ValueError(f"must be an int or a list of 0/1 per layer like [1,0,1], got {value!r}")
        return int(parts[0]) if len(parts) == 1 and not value.strip().startswith("[") else [int(p) for p in parts]
    return value


def _check_layer_freq(value: int | list[int]) -> int | list[int]:
    if isinstance(value, int) and value < 1:
        raise ValueError(f"must be >= 1 (every k-th layer is MoE), got {value}")
    if isinstance(value, list) and (not value or any(v not in (0, 1) for v in value)):
        raise ValueError(f"a per-layer pattern holds only 0 (dense) and 1 (MoE), got {value}")
    return value


IntList = Annotated[list[int], BeforeValidator(_split_list)]
LayerFreq = Annotated[int | list[int], BeforeValidator(_layer_freq), AfterValidator(_check_layer_freq)]
StrList = Annotated[list[str], BeforeValidator(_split_list)]


def _check_lora_targets(value: list[str]) -> list[str]:
    resolve_targets(value)  # unknown names and part of a fused module are refused; the names are kept as given
    return value


LoraTargets = Annotated[list[str], BeforeValidator(_split_list), AfterValidator(_check_lora_targets)]
DataPathList = Annotated[list[str], BeforeValidator(_split_list), AfterValidator(_resolve_list_in_roots)]
"""Paths (optionally with blend weights) that must all resolve inside the data roots when submitted over the API."""
JsonObject = Annotated[dict[str, Any], BeforeValidator(_json_object)]
TriState = Annotated[Literal["true", "false", "none"], BeforeValidator(_tristate)]
DeviceType = Literal["cpu", "cuda", "npu"]
BestBy = Annotated[Literal["lm_loss", "val_lm_loss"], BeforeValidator(metric_name)]
"""A loss metric a checkpoint is ranked by (lower is better); MindSpeed's spellings ("lm loss", "val_loss") accepted."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Resources(_Strict):
    """What the job asks of the cluster: ``nnodes × nproc_per_node`` devices of one type."""

    device_type: DeviceType = Field(
        "cpu", description="Accelerator type the job runs on: cpu (gloo), cuda (nccl) or npu (hccl, Ascend)."
    )
    nnodes: int = Field(1, ge=1, le=1024, description="Hosts the job spans (torchrun --nnodes); one node per host.")
    nproc_per_node: int = Field(
        1, ge=1, le=64, description="Devices (processes) per host (torchrun --nproc-per-node); CPU: process slots."
    )
    pool: str | None = Field(
        None,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="A Slurm pool (the service's LLMJOBS_SLURM_POOLS) to run on instead of the pinned hosts; "
        "None = the pinned hosts.",
    )

    @model_serializer(mode="wrap")
    def _no_pool_for_pinned_hosts(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A pinned hosts' job stores no ``pool``: its resources read (and group in the scheduler) as before pools."""
        data: dict[str, Any] = handler(self)
        if data.get("pool") is None:
            data.pop("pool", None)
        return data

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class JobBase(_Strict):
    """Fields every job has, whatever its kind."""

    name: str | None = Field(None, max_length=200, description="Free-form job name, filterable in GET /v1/jobs.")
    resources: Resources = Field(
        default_factory=Resources,
        description="Devices the job asks for: resources.nnodes × resources.nproc_per_node of resources.device_type.",
    )
    metadata: dict[str, str] = Field(default_factory=dict, description="String labels, filterable in GET /v1/jobs.")
    priority: int = Field(
        0,
        ge=-100,
        le=100,
        description="Higher runs first; within a priority teams take turns (the team holding the fewest devices "
        "goes next), each team's jobs in submission order. At most the team's ceiling (team_priority_ceiling).",
    )
    max_restarts: int | None = Field(
        None, ge=0, le=100, description="Retries after a retryable failure; None = server default."
    )
    start_deadline_s: float | None = Field(
        None, gt=0, description="Fail the job if it has not started within this many seconds."
    )
    run_deadline_s: float | None = Field(
        None, gt=0, description="Cancel the job if it runs longer than this many seconds."
    )


# ---------------------------------------------------------------- shared flag groups


def validate(
    adapter: TypeAdapter[Any],
    data: dict[str, Any] | str | bytes,
    data_roots: list[str] | None,
    read_roots: list[str] | None,
    *,
    strict: bool,
) -> Any:  # Any: what the adapter validates to (a spec of one of its kinds)
    """``data`` (a dict or JSON text) through ``adapter`` with the path context: with ``data_roots`` every path must
    resolve inside them (inputs may also resolve inside ``read_roots``); ``strict`` refuses a string where a number or
    boolean belongs instead of converting it."""
    context: dict[str, Any] = (
        {"data_roots": data_roots, "read_roots": read_roots or []} if data_roots is not None else {}
    )
    if strict:
        context["strict"] = True
    if isinstance(data, (str, bytes)):
        return adapter.validate_json(data, context=context or None, strict=strict or None)
    return adapter.validate_python(data, context=context or None, strict=strict or None)
