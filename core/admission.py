"""Admission: refuse at submission what the engine would refuse before its first step (422 naming the field).

Two passes around the schema (``engine.contract.spec``): ``check_fields`` reads the raw body first, so an unknown field or kind
gets a "did you mean" instead of pydantic's bare ``extra_forbidden``; ``check_admissible`` reads the parsed spec and
the file system: required fields by kind, inputs that must exist, the parallel layout against a checkpoint's shape,
and the ceilings in settings (``max_train_iters``, ``max_train_tokens``; a team's default ``run_deadline_s``).

Checkpoint directories are recognised here by their marker files (config.json, Megatron's tracker / ``iter_*``,
DCP's ``.metadata``), the rule of ``engine.checkpoint.load.detect_format`` without its torch import: the API process
never imports torch. The engine still checks everything again when it runs (a file may vanish meanwhile).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from core import peft_shapes
from core.errors import ApiError
from core.paths import team_areas
from core.reward_hosts import check_http_rewards, stamp_allowed_hosts
from core.settings import Settings
from core.slurm.pools import check_pool_memory
from engine.contract import inspect, layout, owner, rope_scaling
from engine.contract.families import UnknownFamily, family_of_hf
from engine.contract.flags import IGNORED_FLAGS
from engine.contract.indexed import PAIRWISE_FIELDS, instruction_prefix
from engine.contract.model_config import ModelConfig, hf_num_experts
from engine.contract.plan.shape import check_sizes, checkpoint_config, read_json
from engine.contract.runfiles import BadInput
from engine.contract.spec import (
    REFERENCE_PLACEHOLDER_DIR,
    SERVE_TRAINING_FIELDS,
    SPEC_CLASSES,
    STEP_KINDS,
    ConvertSpec,
    EvalSpec,
    JobBase,
    PipelineSpec,
    PreprocessSpec,
    Resources,
    ServeSpec,
    TrainSpec,
    parse_spec,
    serve_training_field,
    substitute_references,
)

# Common spellings from other trainers (transformers, OpenAI fine-tuning) -> this API's MindSpeed names.
SYNONYMS: dict[str, str] = {
    "learning_rate": "lr",
    "max_steps": "train_iters",
    "iters": "train_iters",
    "steps": "train_iters",
    "batch_size": "global_batch_size",
    "max_seq_length": "seq_length",
    "max_length": "seq_length",
    "model": "load",
    "model_path": "load",
    "model_name_or_path": "load",
    "tokenizer": "tokenizer_name_or_path",
    "tokenizer_path": "tokenizer_name_or_path",
    "data": "data_path",
    "dataset": "data_path",
    "output_dir": "save",
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "warmup_steps": "lr_warmup_iters",
    "lora_rank": "lora_r",
    "gpus": "nproc_per_node",
    "num_gpus": "nproc_per_node",
    "gpus_per_node": "nproc_per_node",
    "devices": "nproc_per_node",
    "nodes": "nnodes",
    "num_nodes": "nnodes",
    "device": "device_type",
    "accelerator": "device_type",
    "seed_value": "seed",
}


# What users of other servers (vLLM, TGI, the OpenAI API) call a serve field.
SERVE_SYNONYMS: dict[str, str] = {
    "max_batch_size": "max_num_seqs",
    "batch_size": "max_num_seqs",
    "max_concurrent_requests": "max_num_seqs",
    "max_seq_len": "max_model_len",
    "max_seq_length": "max_model_len",
    "max_length": "max_model_len",
    "context_length": "max_model_len",
    "model_name": "served_model_name",
    "gpu_memory_utilization": "kv_cache_memory_fraction",
    "adapters": "lora_adapters",
    "lora_modules": "lora_adapters",
    "tp": "tensor_model_parallel_size",
    "tensor_parallel_size": "tensor_model_parallel_size",
    "model": "load",
    "model_path": "load",
    "tokenizer": "tokenizer_name_or_path",
}


def _refuse(field: str, message: str) -> ApiError:
    return ApiError(422, "validation_error", f"{field}: {message}", field)


# ---------------------------------------------------------------- unknown fields and kinds


def suggest(name: str, known: Iterable[str]) -> str | None:
    """The known field ``name`` was probably meant as: MindSpeed's flag spelling, a synonym, or the closest name."""
    options = set(known)
    flag = name.lstrip("-").replace("-", "_").lower()
    if flag in options:
        return flag
    if SYNONYMS.get(flag) in options:
        return SYNONYMS[flag]
    close = difflib.get_close_matches(flag, sorted(options), n=1, cutoff=0.7)
    return close[0] if close else None


def _unknown_field(name: str, known: Iterable[str], where: str) -> ApiError:
    field = f"{where}{name}"
    if name.lstrip("-") in IGNORED_FLAGS or name.lstrip("-").replace("_", "-") in IGNORED_FLAGS:
        return _refuse(
            field, "a MindSpeed flag with no effect in this engine (the device layer chooses kernels); remove it"
        )
    guess = suggest(name, known)
    if guess is None and not where.endswith("resources.") and suggest(name, Resources.model_fields):
        guess = f"resources.{suggest(name, Resources.model_fields)}"  # a resources field given at the top level
    hint = f"; did you mean {guess!r}?" if guess else ""
    return _refuse(field, f"unknown field{hint}")


def check_fields(raw: Any, where: str = "") -> None:
    """422 for an unknown ``kind`` (listing the kinds) or an unknown field (with the closest known one)."""
    if not isinstance(raw, dict):
        return  # the schema answers non-objects
    kind = raw.get("kind")
    allowed = STEP_KINDS if where else tuple(SPEC_CLASSES)  # pipelines do not nest
    if kind not in allowed:
        kinds = ", ".join(allowed) + (" (pipelines do not nest)" if where else "")
        guess = suggest(str(kind), allowed) if isinstance(kind, str) else None
        hint = f"; did you mean {guess!r}?" if guess else ""
        what = "is required" if kind is None else f"{kind!r} is not a job kind"
        raise _refuse(f"{where}kind", f"{what}; use one of {kinds}{hint}")
    known = SPEC_CLASSES[kind].model_fields
    for name in raw:
        if kind == "serve" and name in SERVE_TRAINING_FIELDS:
            raise _refuse(f"{where}{name}", serve_training_field(name).split(": ", 1)[1])
        if name not in known:
            if kind == "serve":
                known = {k: v for k, v in known.items() if k not in SERVE_TRAINING_FIELDS}
                guess = SERVE_SYNONYMS.get(name.lstrip("-").replace("-", "_").lower())
                if guess is not None:
                    raise _refuse(f"{where}{name}", f"unknown field; did you mean {guess!r}?")
            raise _unknown_field(name, known, where)
    if isinstance(raw.get("resources"), dict):
        for name in raw["resources"]:
            if name not in Resources.model_fields:
                raise _unknown_field(name, Resources.model_fields, f"{where}resources.")
    if kind == "pipeline" and isinstance(raw.get("steps"), list):
        for i, step in enumerate(raw["steps"]):
            if isinstance(step, dict) and isinstance(step.get("spec"), dict):
                check_fields(step["spec"], f"{where}steps.{i}.spec.")


# ---------------------------------------------------------------- inputs on disk


class _Inputs:
    """Answers "does this input exist?", excepting paths a pipeline's earlier step will write."""

    def __init__(self, where: str, produced: Iterable[str] = ()):
        self.where, self.produced = where, tuple(produced)

    def pending(self, path: str) -> bool:
        return f"/{REFERENCE_PLACEHOLDER_DIR}/" in path or any(path.startswith(p) for p in self.produced)

    def field(self, name: str) -> str:
        return f"{self.where}{name}"

    def file_or_dir(self, name: str, path: str | None) -> None:
        if path is not None and not self.pending(path) and not Path(path).exists():
            raise _refuse(self.field(name), f"{path} does not exist")

    def directory(self, name: str, path: str | None, what: str) -> None:
        if path is None or self.pending(path):
            return
        if not Path(path).is_dir():
            raise _refuse(self.field(name), f"{path} is not a directory ({what})")

    def file(self, name: str, path: str | None) -> None:
        if path is None or self.pending(path):
            return
        if not Path(path).is_file():
            raise _refuse(
                self.field(name), f"{path} is not a file" if Path(path).exists() else f"{path} does not exist"
            )

    def data_prefixes(self, name: str, prefixes: list[str]) -> None:
        """Every prefix has a .bin and .idx, as instruction data, plain or as ``<prefix>_text_document``."""
        for prefix in prefixes:
            if self.pending(prefix):
                continue
            try:
                float(prefix)
            except ValueError:
                pass
            else:
                raise _refuse(self.field(name), f"blending weights ({prefix!r}) are not supported; give prefixes only")
            candidates = [instruction_prefix(prefix, "input_ids"), prefix, prefix + "_text_document"]
            if not any(Path(c + ".bin").is_file() and Path(c + ".idx").is_file() for c in candidates):
                looked = ", ".join(c + ".bin/.idx" for c in candidates)
                raise _refuse(
                    self.field(name),
                    f"no indexed dataset for prefix {prefix!r} (looked for {looked}); preprocess the data first",
                )

    def pairwise_prefixes(self, name: str, prefixes: list[str]) -> None:
        """Every prefix has MindSpeed's pairwise files (``<prefix>_packed_{chosen,rejected}_*``)."""
        for prefix in prefixes:
            if self.pending(prefix):
                continue
            for field in PAIRWISE_FIELDS:
                path = instruction_prefix(prefix, field)
                if not (Path(path + ".bin").is_file() and Path(path + ".idx").is_file()):
                    raise _refuse(
                        self.field(name),
                        f"is_pairwise_dataset: no {path}.bin/.idx for prefix {prefix!r}; preprocess the pairs with "
                        "SharegptStylePairwiseHandler or AlpacaStylePairwiseHandler first",
                    )

    def checkpoint(self, name: str, path: str | None) -> dict[str, Any] | None:
        """A model directory that some loader can read; returns its HF config.json when it has one."""
        if path is None or self.pending(path):
            return None
        p = Path(path)
        if not p.is_dir():
            raise _refuse(self.field(name), f"{path} is not a directory (a model or checkpoint directory)")
        if (p / "config.json").is_file():
            try:
                config = read_json(p / "config.json", name)
            except OSError as err:
                raise _refuse(self.field(name), f"{p / 'config.json'} is not readable JSON ({err})") from None
            except BadInput as err:
                raise _refuse(self.field(name), str(err)) from None
            if not isinstance(config, dict):
                raise _refuse(self.field(name), f"{p / 'config.json'} is not a JSON object")
            try:  # a model family the engine does not run (engine.contract.families), named by its model_type
                family_of_hf(config)
            except UnknownFamily as err:
                raise _refuse(self.field(name), f"{p / 'config.json'}: {err}") from None
            return config
        if inspect.checkpoint_format(p) is None:  # the engine's own detector (engine.checkpoint.load)
            raise _refuse(
                self.field(name),
                f"{path} holds no model: neither an HF model (config.json), a Megatron "
                "checkpoint (latest_checkpointed_iteration.txt, iter_*) nor a training "
                "checkpoint (.metadata)",
            )
        return None

    def full_model(self, name: str, path: str | None) -> None:
        """``path`` is not LoRA adapters alone (which load only over a base model, given in ``load``)."""
        if path is None or self.pending(path):
            return
        held = inspect.contents(path)
        if held is not None and held.needs_base_model:
            raise _refuse(
                self.field(name),
                f"{path} holds LoRA adapters only; give the base model in {name} and this checkpoint in lora_load, "
                'or name the checkpoint by reference ({"job": ID, "iteration": N}) to take the base from its run',
            )

    def adapters(self, name: str, path: str | None, base: ModelConfig | None, per_request: bool = False) -> None:
        """``path`` exists, holds LoRA adapters (not a full model) and, where both shapes can be read, was trained on
        a model of the base's shape (``base``: the ``load`` checkpoint's); a PEFT adapter folder's factors are read
        from its safetensors header. ``per_request``: chosen per request by ``model`` (serve's ``lora_adapters``),
        which a PEFT adapter cannot be (the engine merges it into the base at load)."""
        self.file_or_dir(name, path)
        if path is None or self.pending(path):
            return
        held = inspect.contents(path)
        if held is not None and not held.lora:
            raise _refuse(self.field(name), f"{path} holds full weights, not LoRA adapters")
        if peft_shapes.is_peft_adapter(path):
            self.peft_adapter(name, path, base, per_request)
            return
        try:
            trained = checkpoint_config(path, name) if base is not None else None
        except BadInput:
            return  # unreadable within the limits: the engine tells when it opens it
        if trained is None or base is None:
            return
        for dim in ADAPTER_DIMS:
            mine, theirs = getattr(trained, dim), getattr(base, dim)
            if mine != theirs:
                raise _refuse(
                    self.field(name),
                    f"{path} holds adapters for another model: {dim} {mine} there, {theirs} in the base (load)",
                )

    def peft_adapter(self, name: str, path: str, base: ModelConfig | None, per_request: bool) -> None:
        """A Hugging Face PEFT adapter folder: readable, its LoRA factors as wide as the base's projections."""
        try:
            why = peft_shapes.mismatch(path, base) if base is not None else None
        except peft_shapes.NotAnAdapter as err:
            raise _refuse(self.field(name), f"not a PEFT adapter the engine can load: {err}") from None
        if why is not None:
            raise _refuse(self.field(name), f"{path} holds adapters for another model: {why}")
        if per_request:
            raise _refuse(
                self.field(name),
                f"{path} is an HF PEFT adapter, which is merged into the base at load, so it cannot be chosen per "
                "request; give it as lora_load (one adapter for every request)",
            )


# ---------------------------------------------------------------- checks by kind

# what an adapter's tensors are shaped by: a LoRA checkpoint of another model's shape cannot wrap the base
ADAPTER_DIMS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
)


def _base_config(load: str | None, inputs: _Inputs) -> ModelConfig | None:
    """The ``load`` checkpoint's shape as the torch-free reader tells it; None when it cannot be told."""
    if load is None or inputs.pending(load):
        return None
    try:
        return checkpoint_config(load)
    except BadInput:
        return None


def _check_layout(spec: TrainSpec | EvalSpec | ServeSpec, config: dict[str, Any] | None, where: str) -> None:
    """The engine's one layout rule (``engine.contract.layout``) over the ``load`` checkpoint's shape, whatever its
    kind (HF, Megatron, our own); the spec's own flags were checked by the schema with the same rule."""
    try:
        shape = _checkpoint_shape(spec.load, config)
    except BadInput as err:  # a file holding the shape refused, out of bounds or unreadable within the limits
        raise _refuse(f"{where}load", str(err)) from None
    if shape is None:
        return
    dims = spec.parallel_dims  # the one way a spec becomes dims (CP included)
    if spec.kind != "train":
        dims = dataclasses.replace(dims, ep=1)  # eval and serve run every expert on each rank
    try:
        layout.check(shape, dims, spec.num_layer_list, spec.num_layers_per_virtual_pipeline_stage)
    except layout.LayoutError as err:
        raise _refuse(f"{where}{err.field}", err.why) from None


def _checkpoint_shape(load: str | None, config: dict[str, Any] | None) -> layout.Shape | None:
    """The shape the layout rule reads: the HF config's (leniently, field by field, when it is not a whole Qwen3
    config), else whatever the torch-free reader finds in the checkpoint; None when nothing can be told.
    ``BadInput`` for a size out of range or a file refused or unreadable within the reader's limits."""
    if config:
        check_sizes(config, "config.json", "load", lenient=True)  # before any size is computed with
        try:
            return layout.Shape.of(ModelConfig.from_hf(config))
        except (KeyError, ValueError, TypeError):
            ints = {k: v if isinstance(v, int) else None for k, v in config.items()}
            return layout.Shape(
                num_layers=ints.get("num_hidden_layers"),
                num_attention_heads=ints.get("num_attention_heads"),
                num_query_groups=ints.get("num_key_value_heads"),
                num_experts=hf_num_experts(config) or 0,
            )
    if load is None:
        return None
    cfg = checkpoint_config(load)
    return layout.Shape.of(cfg) if cfg is not None else None


def _check_serve(spec: ServeSpec, inputs: _Inputs) -> None:
    """As eval's model and tokenizer checks (serving's ranks rule is the spec's: ``ServeSpec._check_ranks``)."""
    config = inputs.checkpoint("load", spec.load)
    inputs.full_model("load", spec.load)
    _check_layout(spec, config, inputs.where)
    _check_positions(spec, config or _stored_positions(spec.load), inputs.where, "max_model_len")
    base = _base_config(spec.load, inputs) if spec.lora_load or spec.lora_adapters else None
    inputs.adapters("lora_load", spec.lora_load, base)
    for name, path in spec.lora_adapters.items():
        inputs.adapters(f"lora_adapters.{name}", path, base, per_request=True)
    if spec.tokenizer_name_or_path is not None:
        inputs.directory("tokenizer_name_or_path", spec.tokenizer_name_or_path, "a Hugging Face tokenizer directory")
    elif not inputs.pending(spec.load) and not (Path(spec.load) / "tokenizer_config.json").is_file():
        raise _refuse(inputs.field("tokenizer_name_or_path"), f"required ({spec.load} holds no tokenizer)")


def _check_train(spec: TrainSpec, inputs: _Inputs, settings: Settings) -> None:
    where = inputs.where
    if spec.seq_length is None:
        raise _refuse(f"{where}seq_length", "required for training (the longest sample, in tokens)")
    if spec.lr_decay_style == "WSD":
        raise _refuse(
            f"{where}lr_decay_style", "WSD is not supported; use constant, linear, cosine or inverse-square-root"
        )
    if spec.load is None:
        for flag in ("num_layers", "hidden_size", "num_attention_heads"):
            if getattr(spec, flag) is None:
                raise _refuse(f"{where}{flag}", "required when no checkpoint is loaded (give load, or the model shape)")
        if spec.padded_vocab_size is None and spec.tokenizer_name_or_path is None:
            raise _refuse(
                f"{where}padded_vocab_size", "required without load and without tokenizer_name_or_path (a vocab source)"
            )
    inputs.directory("tokenizer_name_or_path", spec.tokenizer_name_or_path, "a Hugging Face tokenizer directory")
    if spec.is_pairwise_dataset:
        inputs.pairwise_prefixes("data_path", spec.data_path)
    else:
        inputs.data_prefixes("data_path", spec.data_path)
    config = inputs.checkpoint("load", spec.load)
    inputs.checkpoint("ref_model", spec.ref_model)
    _check_layout(spec, config, where)
    _check_positions(spec, config, where)
    _check_resume(spec, inputs)
    check_http_rewards(spec, settings, where)
    if settings.max_train_iters and spec.train_iters > settings.max_train_iters:
        raise _refuse(
            f"{where}train_iters",
            f"{spec.train_iters} is over this service's ceiling of "
            f"{settings.max_train_iters} iterations (max_train_iters)",
        )
    tokens = spec.train_iters * spec.effective_global_batch_size * spec.seq_length
    if settings.max_train_tokens and tokens > settings.max_train_tokens:
        raise _refuse(
            f"{where}train_iters",
            f"train_iters × global_batch_size × seq_length = {tokens} tokens, over "
            f"this service's ceiling of {settings.max_train_tokens} "
            "(max_train_tokens)",
        )


def _stored_positions(load: str | None) -> dict[str, Any] | None:
    """A checkpoint without an HF config.json (Megatron args, our meta.json): its positions as the config the check
    reads, so serving refuses a ``max_model_len`` past them as it does for an HF model. A YaRN checkpoint gives none
    (its stretched positions are not checked here: the engine reads the scaling from the same args)."""
    cfg = checkpoint_config(load) if load is not None else None
    if cfg is None or cfg.rope_scaling_type:
        return None
    return {"max_position_embeddings": cfg.max_position_embeddings}


def _check_positions(
    spec: TrainSpec | EvalSpec | ServeSpec, config: dict[str, Any] | None, where: str, field: str = "seq_length"
) -> None:
    """A sample (serving: a sequence, ``max_model_len``) longer than the positions the model reaches (its RoPE
    tables, stretched by YaRN when the checkpoint or the spec sets it) is refused, not run."""
    positions = spec.max_position_embeddings or (config or {}).get("max_position_embeddings")
    length = getattr(spec, field)
    if length is None or not isinstance(positions, int) or length <= positions:
        return
    try:
        scaling = {**rope_scaling.from_hf(config or {}), **rope_scaling.from_flags(spec)}
    except ValueError as err:
        raise _refuse(f"{where}load", str(err)) from None
    if scaling.get("rope_scaling_type"):
        original = scaling.get("rope_scaling_original_max_position_embeddings") or positions
        stretched = int(original * scaling.get("rope_scaling_factor", 1.0))
        if length <= stretched:
            return
        raise _refuse(
            f"{where}{field}",
            f"{length} is longer than the {stretched} positions YaRN reaches "
            f"(rope_scaling_original_max_position_embeddings × rope_scaling_factor); lower {field} or raise "
            "rope_scaling_factor",
        )
    raise _refuse(
        f"{where}{field}",
        f"{length} is longer than the model's {positions} positions (max_position_embeddings); lower "
        f"{field}, or stretch the positions with rope_scaling_type yarn, rope_scaling_factor and "
        "rope_scaling_original_max_position_embeddings",
    )


def _check_resume(spec: TrainSpec, inputs: _Inputs) -> None:
    """A new job never silently continues another job's run under ``save`` (nor "trains" 0 steps on a finished one):
    it must say ``resume: "auto"``, and then leave iterations to train. A retry of the same job is no submission."""
    if spec.save is None or inputs.pending(spec.save):
        return
    found = owner.saved_run(spec.save)
    if found is None:
        return
    if spec.resume != "auto":
        raise _refuse(
            inputs.field("save"),
            f"{spec.save} already holds the run of {owner.describe(found)} at iteration {found.iteration}; "
            'give a new save, or set resume: "auto" to continue that run',
        )
    if found.iteration >= spec.train_iters:
        raise _refuse(
            inputs.field("train_iters"),
            f"the run under save ({owner.describe(found)}) is already at iteration {found.iteration}, so "
            f"train_iters {spec.train_iters} leaves nothing to train; raise train_iters to continue it",
        )


def _check_eval(spec: EvalSpec, inputs: _Inputs) -> None:
    if spec.deployment_url is not None:  # a worker would POST there: only the service sets it (from deployment)
        raise _refuse(inputs.field("deployment_url"), "set by the service; name your deployment in deployment")
    inputs.file("eval_data_path", spec.eval_data_path)
    if spec.tokenizer_name_or_path is not None:
        inputs.directory("tokenizer_name_or_path", spec.tokenizer_name_or_path, "a Hugging Face tokenizer directory")
    if spec.remote or spec.load is None:  # generated through a deployment (core.deployments filled the tokenizer)
        if spec.tokenizer_name_or_path is None:
            raise _refuse(inputs.field("tokenizer_name_or_path"), "required to read the test set of a deployment")
        return
    config = inputs.checkpoint("load", spec.load)
    inputs.full_model("load", spec.load)
    inputs.adapters("lora_load", spec.lora_load, _base_config(spec.load, inputs) if spec.lora_load else None)
    own = inputs.pending(spec.load) or (Path(spec.load) / "tokenizer_config.json").is_file()
    if spec.tokenizer_name_or_path is None and not own:
        raise _refuse(inputs.field("tokenizer_name_or_path"), f"required ({spec.load} holds no tokenizer)")
    _check_layout(spec, config, inputs.where)
    _check_positions(spec, config, inputs.where)


def _check_convert(spec: ConvertSpec, inputs: _Inputs) -> None:
    config = inputs.checkpoint("load_dir", spec.load_dir)
    if not inputs.pending(spec.load_dir):
        is_hf = config is not None and any(
            n.suffix == ".safetensors" or n.name == "model.safetensors.index.json"
            for n in Path(spec.load_dir).iterdir()
        )
        if spec.load_model_type == "hf" and not is_hf:
            raise _refuse(
                inputs.field("load_model_type"),
                f"hf, but {spec.load_dir} is not an HF model directory (config.json + *.safetensors)",
            )
        if spec.load_model_type == "mg" and is_hf:
            raise _refuse(inputs.field("load_model_type"), f"mg, but {spec.load_dir} is an HF model directory")
    inputs.file_or_dir("lora_load", spec.lora_load)
    inputs.file_or_dir("tokenizer_model", spec.tokenizer_model)
    inputs.directory("hf_cfg_dir", spec.hf_cfg_dir, "an HF model directory")


def _check_preprocess(spec: PreprocessSpec, inputs: _Inputs) -> None:
    inputs.file_or_dir("input", spec.input)
    inputs.directory("tokenizer_name_or_path", spec.tokenizer_name_or_path, "a Hugging Face tokenizer directory")


def _check_one(spec: JobBase, inputs: _Inputs, settings: Settings) -> None:
    if isinstance(spec, TrainSpec):
        _check_train(spec, inputs, settings)
    elif isinstance(spec, EvalSpec):
        _check_eval(spec, inputs)
    elif isinstance(spec, ServeSpec):
        _check_serve(spec, inputs)
    elif isinstance(spec, ConvertSpec):
        _check_convert(spec, inputs)
    elif isinstance(spec, PreprocessSpec):
        _check_preprocess(spec, inputs)


def _outputs(spec: JobBase) -> list[str]:
    """What a step writes, so later steps may name it literally as well as by reference."""
    names = ("output_prefix", "save_dir", "save")
    return [value for value in (getattr(spec, n, None) for n in names) if isinstance(value, str)]


def _check_pipeline(spec: PipelineSpec, settings: Settings, team: str) -> None:
    areas = team_areas(settings, team)
    base = areas.write[0]  # the base of the placeholders, as in the spec's own validator
    produced: list[str] = []
    for i, step in enumerate(spec.steps):
        placeheld = substitute_references(step.spec, lambda ref, key: str(base / REFERENCE_PLACEHOLDER_DIR / ref / key))
        child = parse_spec(placeheld, **areas.context())  # valid: the pipeline's own validator parsed it already
        _check_one(child, _Inputs(f"steps.{i}.spec.", produced), settings)
        produced.extend(_outputs(child))


def check_admissible(spec: JobBase, settings: Settings, team: str) -> None:
    """422 naming the field for a spec ``team``'s job would have refused by the engine before its first step
    (pipelines: every step)."""
    if isinstance(spec, PipelineSpec):
        _check_pipeline(spec, settings, team)
    else:
        _check_one(spec, _Inputs(""), settings)
        if spec.resources.pool is not None:  # the planner against the Slurm pool's device memory
            check_pool_memory(settings, spec)


def apply_team_defaults(spec: JobBase, settings: Settings, team: str) -> None:
    """A team's default run deadline on a spec that sets none, and the admin's allow decision for stage grpo's http
    reward URLs (both stored with the spec, so the worker enforces them)."""
    stamp_allowed_hosts(spec, settings)
    deadline = settings.run_deadline_for(team)
    if spec.run_deadline_s is None and deadline and not isinstance(spec, PipelineSpec):
        spec.run_deadline_s = float(deadline)  # assignment marks the field set, so spec_to_json keeps it
