"""The serving request, typed once: what one generation asks of a deployment's engine (``POST /v1/generate``).

Three places speak it and none spells it again: the API's OpenAI routes parse OpenAI's JSON into a ``ServeRequest``
(``app.openai_format``), the engine's server reads one from each body (``engine.serve.protocol``), and a remote eval
builds one per test prompt (``engine.eval.remote``). A field added here is a JSON field of the engine's protocol, type
checked and range checked, with its default, in all three.

The wire form is flat JSON: ``SamplingOptions``' fields beside the prompt (one of ``messages``, ``prompt``,
``prompt_token_ids``), ``model`` (one of the deployment's LoRA adapters, absent or the served name: the base),
``structured`` (a grammar every sampled token keeps to: ``json_schema``, ``regex``, ``choice`` or ``lark``),
``tools``, ``chat_template_kwargs`` and ``stream`` (accepted, the engine always streams). JSON ``null`` reads as
absent. A bad value is a ``RequestError`` naming its field: the API answers it in OpenAI's shape, the engine as a 400.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard, TypeVar

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_N = 16
MAX_STOP = 4  # OpenAI's limit on stop strings
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


class RequestError(ValueError):
    """A serving request field with a wrong JSON type (``code`` invalid_type) or value (invalid_value)."""

    def __init__(self, field: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.detail, self.code = field, message, code


T = TypeVar("T")


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)  # json.loads reads NaN and Infinity


def _is_strings(v: object) -> bool:
    return isinstance(v, str) or (isinstance(v, list | tuple) and all(isinstance(s, str) for s in v))


@dataclasses.dataclass(frozen=True)
class Kind:
    """A JSON type: its test and how an error names it ("must be <name>")."""

    name: str
    test: Callable[[object], bool]

    def check(self, field: str, value: object) -> None:
        if not self.test(value):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise RequestError(field, f"must be {self.name}, got {shown}", "invalid_type")


INTEGER, NUMBER = Kind("an integer", _is_int), Kind("a finite number", _is_number)
STRING, BOOL = Kind("a string", lambda v: isinstance(v, str)), Kind("true or false", lambda v: isinstance(v, bool))
OBJECT, LIST = Kind("an object", lambda v: isinstance(v, dict)), Kind("a list", lambda v: isinstance(v, list))
STRINGS = Kind("a string or a list of strings", _is_strings)
TOKEN_IDS = Kind("a list of token ids", lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v))


def _option(default: T, kind: Kind, ok: Callable[[Any], bool], rule: str) -> T:  # Any: ok reads the kind's type
    """A sampling field: its default, JSON type and range (``ok`` sees a value of that type, never None)."""
    return dataclasses.field(default=default, metadata={"kind": kind, "ok": ok, "rule": rule})


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How the engine samples one request's choices (OpenAI's and vLLM's names, ranges and defaults)."""

    max_tokens: int | None = _option(None, INTEGER, lambda v: v >= 1, "must be >= 1")  # None: up to max_model_len
    temperature: float = _option(1.0, NUMBER, lambda v: 0.0 <= v <= 2.0, "must be in [0, 2]")
    top_p: float = _option(1.0, NUMBER, lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
    top_k: int = _option(0, INTEGER, lambda v: v >= 0, "must be >= 0 (0: off)")
    seed: int | None = _option(None, INTEGER, lambda v: SEED_RANGE[0] <= v < SEED_RANGE[1], "must be a 64-bit integer")
    n: int = _option(1, INTEGER, lambda v: 1 <= v <= MAX_N, f"must be in [1, {MAX_N}]")
    stop: tuple[str, ...] = _option(
        (), STRINGS, lambda v: len(v) <= MAX_STOP and all(v), f"at most {MAX_STOP} non-empty strings"
    )
    presence_penalty: float = _option(0.0, NUMBER, lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]")
    frequency_penalty: float = _option(0.0, NUMBER, lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]")
    repetition_penalty: float = _option(1.0, NUMBER, lambda v: 0.0 < v <= 10.0, "must be in (0, 10]")
    # None: none; k >= 0: the chosen token's and the k most likely
    logprobs: int | None = _option(None, INTEGER, lambda v: 0 <= v <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]")

    def __post_init__(self) -> None:
        given = [f for f in dataclasses.fields(self) if not (getattr(self, f.name) is None and f.default is None)]
        for f in given:
            f.metadata["kind"].check(f.name, getattr(self, f.name))
        if not isinstance(self.stop, tuple):  # JSON's "x" or ["x", "y"]: one tuple inside
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        for f in given:
            if not f.metadata["ok"](getattr(self, f.name)):
                raise RequestError(f.name, f"{f.metadata['rule']}, got {getattr(self, f.name)!r}")

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> SamplingOptions:
        """The options among ``values`` (other keys ignored; null is absent)."""
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if values.get(f.name) is not None})

    def to_json(self) -> dict[str, Any]:
        """The fields that differ from their defaults (``stop`` as a list)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}
        return {**out, "stop": list(self.stop)} if self.stop else out


OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingOptions))
OPTION_KINDS: dict[str, Kind] = {f.name: f.metadata["kind"] for f in dataclasses.fields(SamplingOptions)}
PROMPT_FIELDS = ("messages", "prompt", "prompt_token_ids")


@dataclasses.dataclass(frozen=True)
class ServeRequest:
    """One generation request to an engine: the prompt, the sampling options and what else shapes the answer."""

    options: SamplingOptions = SamplingOptions()
    # the prompt, one of: chat turns (rendered with the deployment's template), text (tokenized as it is), token ids
    messages: list[dict[str, Any]] | None = dataclasses.field(default=None, metadata={"kind": LIST})
    prompt: str | None = dataclasses.field(default=None, metadata={"kind": STRING})
    prompt_token_ids: list[int] | None = dataclasses.field(default=None, metadata={"kind": TOKEN_IDS})
    # a LoRA adapter of the deployment (None or the served name: the base)
    model: str | None = dataclasses.field(default=None, metadata={"kind": STRING})
    # engine.serve.structured's grammar: json_schema, regex, choice or lark
    structured: dict[str, Any] | None = dataclasses.field(default=None, metadata={"kind": OBJECT})
    # tool definitions (rendered as Qwen3 does) and the template's switches (enable_thinking)
    tools: list[Any] | None = dataclasses.field(default=None, metadata={"kind": LIST})
    chat_template_kwargs: dict[str, Any] | None = dataclasses.field(default=None, metadata={"kind": OBJECT})
    # accepted for clients that send it: the engine always streams
    stream: bool | None = dataclasses.field(default=None, metadata={"kind": BOOL})

    def __post_init__(self) -> None:
        for name, kind in _KINDS.items():
            if getattr(self, name) is not None:
                kind.check(name, getattr(self, name))

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ServeRequest:
        """A request body read field by field: an unknown field or a bad value is a ``RequestError`` naming it."""
        unknown = sorted(set(body) - set(OPTION_FIELDS) - set(_KINDS))
        if unknown:
            raise RequestError(unknown[0], "unknown field")
        given = {name: body[name] for name in _KINDS if body.get(name) is not None}
        return cls(options=SamplingOptions.from_json(body), **given)

    def to_json(self) -> dict[str, Any]:
        """The flat JSON body (absent fields and default options left out): ``from_json`` reads it back equal."""
        given = {name: getattr(self, name) for name in _KINDS if getattr(self, name) is not None}
        return {**self.options.to_json(), **given}


_KINDS: dict[str, Kind] = {f.name: f.metadata["kind"] for f in dataclasses.fields(ServeRequest) if f.metadata}
REQUEST_FIELDS = frozenset(OPTION_FIELDS) | frozenset(_KINDS)
