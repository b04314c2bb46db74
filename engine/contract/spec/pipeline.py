"""The pipeline kind: steps run one after another, ``${steps.<name>.outputs.<key>}`` references between them, and
the one parser of a nested spec's first error."""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from engine.contract.spec.common import (
    JobBase,
    _Strict,
    validate,
)
from engine.contract.spec.convert import ConvertSpec
from engine.contract.spec.evaluate import EvalSpec
from engine.contract.spec.preprocess import PreprocessSpec
from engine.contract.spec.train import TrainSpec

STEP_KINDS = ("preprocess", "convert", "train", "eval")
# A step is one of these kinds, validated as parse_spec validates a job (the package's parser holds this module's
# PipelineSpec, so a step has its own adapter: pipelines do not nest)
_STEP_ADAPTER: TypeAdapter[Any] = TypeAdapter(
    Annotated[PreprocessSpec | ConvertSpec | TrainSpec | EvalSpec, Field(discriminator="kind")]
)
REFERENCE = re.compile(r"\$\{steps\.([A-Za-z][A-Za-z0-9_-]{0,63})\.outputs\.([A-Za-z0-9_-]+)\}")
_ANY_REFERENCE = re.compile(r"\$\{[^}]*\}?")
REFERENCE_PLACEHOLDER_DIR = ".pipeline-refs"
# The keys of each kind's result.json outputs (the engine's job runners write exactly these); some only with a flag.
OUTPUT_KEYS: dict[str, tuple[str, ...]] = {
    "preprocess": ("data_path", "output_prefix", "files"),
    "convert": ("checkpoint",),
    "train": ("checkpoint", "checkpoint_iteration", "checkpoint_dir", "hf", "tensorboard"),
    "eval": ("predictions", "result"),
}
OUTPUT_FLAGS: dict[tuple[str, str], str] = {("train", "hf"): "save_hf", ("train", "tensorboard"): "tensorboard_dir"}


def _placeholder_path(base: Path, ref: str, key: str) -> str:
    return str(base / REFERENCE_PLACEHOLDER_DIR / ref / key)


def find_references(value: object, where: str = "") -> list[tuple[str, str, str]]:
    """``(field, step, output key)`` for every ``${steps.<step>.outputs.<key>}`` in a step spec (strings anywhere)."""
    if isinstance(value, dict):
        return [ref for k, v in value.items() for ref in find_references(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, list):
        return [ref for i, v in enumerate(value) for ref in find_references(v, f"{where}.{i}")]
    if not isinstance(value, str):
        return []
    for match in _ANY_REFERENCE.finditer(value):
        if not REFERENCE.fullmatch(match.group(0)):
            raise ValueError(f"{where}: malformed reference {match.group(0)!r}; write ${{steps.<name>.outputs.<key>}}")
    return [(where, m.group(1), m.group(2)) for m in REFERENCE.finditer(value)]


def substitute_references(value: Any, resolve: Callable[[str, str], str]) -> Any:  # Any: JSON in, the same shape out
    """A copy of ``value`` with every reference replaced by ``resolve(step, key)``."""
    if isinstance(value, dict):
        return {k: substitute_references(v, resolve) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute_references(v, resolve) for v in value]
    if isinstance(value, str):
        return REFERENCE.sub(lambda m: resolve(m.group(1), m.group(2)), value)
    return value


# "field: message" raised by a validator, behind pydantic's "Value error, " prefix: the one parser of that shape.
FIELD_MESSAGE = re.compile(r"^(?:Value error, )?([a-z_][a-z0-9_.]*): (.*)$", re.DOTALL)


_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false"}


def error_message(item: Mapping[str, object]) -> str:
    """pydantic's message of one error; a string sent where a number or boolean belongs (refused by the strict API)
    says what to send instead."""
    expected = _EXPECTED.get(str(item.get("type")))
    if expected and isinstance(item.get("input"), str):
        return f"expected {expected}, got the string {item['input']!r} (strings are not converted; drop the quotes)"
    return str(item.get("msg", "invalid"))


def first_error(err: ValidationError, prefix: str) -> str:
    """A nested spec's first validation error as "<prefix>.<field>: message" (the kind tag dropped from the path)."""
    item = err.errors()[0]
    parts = [str(p) for p in item.get("loc", ())]
    if parts and parts[0] in STEP_KINDS:
        parts = parts[1:]
    field, message = ".".join(parts), error_message(item)
    named = FIELD_MESSAGE.match(message)
    if named:
        field, message = (f"{field}.{named.group(1)}" if field else named.group(1)), named.group(2)
    return f"{prefix}.{field}: {message}" if field else f"{prefix}: {message}"


class PipelineStep(_Strict):
    """One step of a pipeline; ``${steps.<name>.outputs.<key>}`` in its spec refers to an earlier step's outputs."""

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$",
        description="Step name, unique in the pipeline; referenced as ${steps.<name>.outputs.<key>}.",
    )
    spec: dict[str, Any] = Field(..., description="A preprocess, convert, train or eval spec.")


class PipelineSpec(JobBase):
    """An ordered list of jobs run one after another as child jobs (driven by ``core.pipelines``, not the engine).

    A step's spec may contain ``${steps.<name>.outputs.<key>}`` (whole or inside a string) naming an output of an
    EARLIER step's result.json; it is replaced when that step has succeeded. At submission every step is validated as
    its kind with each reference replaced by a placeholder path inside the first data root
    (``<root>/.pipeline-refs/<step>/<key>``), so references belong in path/string fields. The pipeline's own
    ``resources`` are unused (each step asks for its own).
    """

    kind: Literal["pipeline"] = Field("pipeline", description='Job kind "pipeline" (the discriminator).')
    steps: list[PipelineStep] = Field(
        ...,
        min_length=1,
        max_length=32,
        description="The steps, run in order, each a preprocess, convert, train or eval spec (1 to 32).",
    )
    on_failure: Literal["fail_fast", "continue"] = Field(
        "fail_fast",
        description="fail_fast: the first failed step fails the pipeline and nothing more runs; continue: "
        "later steps still run unless they refer to a step that did not succeed (those are skipped).",
    )

    @model_validator(mode="after")
    def _check_steps(self, info: ValidationInfo) -> PipelineSpec:
        roots = (info.context or {}).get("data_roots") if info.context else None
        read_roots = (info.context or {}).get("read_roots") if info.context else None
        names = [s.name for s in self.steps]
        earlier: list[str] = []
        for i, step in enumerate(self.steps):
            where = f"steps.{i}.spec"
            if step.name in earlier:
                raise ValueError(f"steps.{i}.name: {step.name!r} is already the name of an earlier step")
            if step.spec.get("kind") not in STEP_KINDS:
                raise ValueError(
                    f"{where}.kind: must be one of {', '.join(STEP_KINDS)} (pipelines do not nest), "
                    f"not {step.spec.get('kind')!r}"
                )
            for field, ref, key in find_references(step.spec, where):
                if ref not in names:
                    close = difflib.get_close_matches(ref, names, n=1, cutoff=0.6)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise ValueError(f"{field}: refers to unknown step {ref!r} (steps: {', '.join(names)}){hint}")
                if ref not in earlier:
                    raise ValueError(f"{field}: refers to step {ref!r}, which does not run before step {step.name!r}")
                _check_output_key(field, ref, key, self.steps[names.index(ref)].spec)
            base = Path(roots[0]) if roots else Path("/")
            placeheld = substitute_references(step.spec, functools.partial(_placeholder_path, base))
            try:
                validate(_STEP_ADAPTER, placeheld, roots, read_roots, strict=bool((info.context or {}).get("strict")))
            except ValidationError as err:
                raise ValueError(first_error(err, where)) from None
            earlier.append(step.name)
        return self


def _check_output_key(field: str, step: str, key: str, producer: dict[str, Any]) -> None:
    """``key`` is an output the producing step's kind writes (with the flag it needs), else a "did you mean"."""
    kind = str(producer.get("kind"))
    keys = OUTPUT_KEYS.get(kind, ())
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{field}: step {step!r} ({kind}) has no output {key!r}; its outputs are {', '.join(keys)}{hint}"
        )
    flag = OUTPUT_FLAGS.get((kind, key))
    if flag and not producer.get(flag):
        raise ValueError(f"{field}: step {step!r} writes output {key!r} only with {flag} set, and it does not set it")
