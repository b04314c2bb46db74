"""Job specs: one pydantic schema shared by the API, the worker and the engine, one module per kind.

Field names are MindSpeed-LLM's command-line flags in snake_case (``--tensor-model-parallel-size`` ->
``tensor_model_parallel_size``) with MindSpeed's meaning and default, flat at the top level of a spec, so a user who
knows MindSpeed knows this API and ``python -m engine <kind>`` maps flag for flag (see ``engine.contract.flags``).
The only nested objects are ``resources`` and ``metadata`` (and a pipeline's ``steps``).

Path fields are checked against the caller's data areas when the spec is validated with
``context={"data_roots": [...], "read_roots": [...]}`` (the API does this with the team's areas, ``core.paths``):
outputs only inside ``data_roots``, inputs also inside ``read_roots``. The engine, run standalone, trusts its user;
run by a worker it re-checks every path right before opening it (``engine.contract.guard``).
This package must not import torch.

The rooms: ``common`` (path and list field types, ``Resources``, ``JobBase``), ``args`` (``ModelArgs``,
``ParallelArgs``), one module per kind (``preprocess``, ``convert``, ``train`` with ``grpo``'s rewards, ``evaluate``,
``serve``, ``pipeline``); this module holds the discriminated union and the parser, and re-exports every name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from engine.contract.spec.args import ModelArgs, ParallelArgs
from engine.contract.spec.common import (
    LINK_SCAN_ENTRIES,
    BestBy,
    DataPath,
    DataPathList,
    DeviceType,
    IntList,
    JobBase,
    JsonObject,
    LayerFreq,
    LoraTargets,
    OutputPath,
    Resources,
    StrList,
    TriState,
    _is_number,
    _resolve_in_roots,
    _resolve_list_in_roots,
    _resolve_output,
    validate,
    within,
)
from engine.contract.spec.convert import ConvertSpec
from engine.contract.spec.evaluate import EvalSpec
from engine.contract.spec.grpo import GRPO_FIELDS, HTTP_REWARD_FIELDS, HTTP_REWARD_MAX_URL, RewardFunc, RewardName
from engine.contract.spec.pipeline import (
    FIELD_MESSAGE,
    OUTPUT_FLAGS,
    OUTPUT_KEYS,
    REFERENCE,
    REFERENCE_PLACEHOLDER_DIR,
    STEP_KINDS,
    PipelineSpec,
    PipelineStep,
    error_message,
    find_references,
    first_error,
    substitute_references,
)
from engine.contract.spec.preprocess import PreprocessSpec
from engine.contract.spec.serve import SERVE_TRAINING_FIELDS, SERVED_NAME, ServeSpec, serve_training_field
from engine.contract.spec.train import TrainSpec

__all__ = [
    "FIELD_MESSAGE",
    "GRPO_FIELDS",
    "HTTP_REWARD_FIELDS",
    "HTTP_REWARD_MAX_URL",
    "LINK_SCAN_ENTRIES",
    "OUTPUT_FLAGS",
    "OUTPUT_KEYS",
    "REFERENCE",
    "REFERENCE_PLACEHOLDER_DIR",
    "SERVED_NAME",
    "SERVE_TRAINING_FIELDS",
    "SPEC_CLASSES",
    "STEP_KINDS",
    "BestBy",
    "ConvertSpec",
    "DataPath",
    "DataPathList",
    "DeviceType",
    "EvalSpec",
    "IntList",
    "JobBase",
    "JobSpec",
    "JsonObject",
    "LayerFreq",
    "LoraTargets",
    "ModelArgs",
    "ModelSpec",
    "OutputPath",
    "ParallelArgs",
    "PipelineSpec",
    "PipelineStep",
    "PreprocessSpec",
    "Resources",
    "RewardFunc",
    "RewardName",
    "ServeSpec",
    "StrList",
    "TrainSpec",
    "TriState",
    "_is_number",
    "_resolve_in_roots",
    "_resolve_list_in_roots",
    "_resolve_output",
    "error_message",
    "find_references",
    "first_error",
    "load_spec_file",
    "parse_spec",
    "serve_training_field",
    "spec_to_json",
    "substitute_references",
    "within",
]

JobSpec = Annotated[
    PreprocessSpec | ConvertSpec | TrainSpec | EvalSpec | ServeSpec | PipelineSpec, Field(discriminator="kind")
]
ModelSpec = TrainSpec | EvalSpec | ServeSpec  # the kinds that build a model: what the loaders and the planner read
SPEC_CLASSES: dict[str, type[JobBase]] = {
    "preprocess": PreprocessSpec,
    "convert": ConvertSpec,
    "train": TrainSpec,
    "eval": EvalSpec,
    "serve": ServeSpec,
    "pipeline": PipelineSpec,
}
_adapter: TypeAdapter[Any] = TypeAdapter(JobSpec)


def spec_to_json(spec: JobBase) -> dict[str, Any]:
    """The stored form of a spec (job row, ``spec.json``): only the fields the user set, plus ``kind`` and the full
    ``resources``. Keeping unset fields out lets the engine tell an explicit flag from a default (a model-shape flag
    left unset comes from the checkpoint's config, not from Megatron's generic default)."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    data["kind"] = spec.kind  # type: ignore[attr-defined]
    data["resources"] = spec.resources.model_dump(mode="json")
    return data


def parse_spec(
    data: dict[str, Any] | str | bytes,
    data_roots: list[str] | None = None,
    read_roots: list[str] | None = None,
    *,
    strict: bool = False,
) -> JobBase:
    """Validate a spec (dict or JSON text); with ``data_roots`` every path must resolve inside them (inputs may also
    resolve inside ``read_roots``); relative paths start at the first of ``data_roots``. ``strict`` (the API) refuses
    a string where a number or boolean belongs ("20", "3e-3", "yes") instead of converting it, in pipeline steps too."""
    spec: JobBase = validate(_adapter, data, data_roots, read_roots, strict=strict)
    return spec


def load_spec_file(path: str | os.PathLike[str]) -> JobBase:
    return parse_spec(Path(path).read_text())
