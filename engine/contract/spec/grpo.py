"""Stage grpo's own fields: the rule rewards (``RewardFunc``) and the names of the fields only grpo takes."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from engine.contract import net_rules
from engine.contract.spec.common import (
    JsonObject,
    _Strict,
)

RewardName = Literal["exact_match", "contains", "regex", "json_schema", "length", "format", "http"]
HTTP_REWARD_FIELDS = ("url", "timeout_s", "retries", "batch_size", "allowed_hosts")
HTTP_REWARD_MAX_URL = 2048
GRPO_FIELDS = (
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "beta",
    "epsilon",
    "epsilon_high",
    "num_iterations",
    "loss_type",
    "scale_rewards",
    "advantage_eps",
    "kl_clamp",
    "mask_truncated_completions",
    "reward_funcs",
    "reward_weights",
)


def _scale_rewards(value: object) -> object:
    """TRL's booleans: true is "group", false is "none"."""
    if value is True:
        return "group"
    if value is False:
        return "none"
    return value


class RewardFunc(_Strict):
    """One built-in rule reward of stage grpo, scored on the completion's text (no user code runs on a worker)."""

    name: RewardName = Field(
        ...,
        description="exact_match (1 if the answer equals the reference answer, whitespace-trimmed), contains (1 if "
        "the answer contains the reference), regex (1 if pattern matches the answer), json_schema (1 if the answer "
        "parses as JSON and validates against schema), length (DAPO's overlong penalty: 0 up to "
        "max_completion_length - overlong_buffer tokens, then linearly down to -1 at max_completion_length), "
        "format (1 if the completion is Qwen3's <think>...</think> block followed by a non-empty answer), http (the "
        'team\'s own reward service at url scores batches: POST {"items": [{prompt, completion, reference}]} answered '
        '{"rewards": [number or null]}).',
    )
    label: str | None = Field(
        None,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The name in the metrics (rewards/<label>/mean) and completions.jsonl; default the name.",
    )
    strip_thinking: bool = Field(
        True,
        description="Score the answer after the <think>...</think> block (exact_match, contains, regex, json_schema).",
    )
    pattern: str | None = Field(None, max_length=2000, description="regex: the pattern (Python `regex` syntax).")
    json_schema: JsonObject | None = Field(None, description="json_schema: the JSON Schema the answer must satisfy.")
    overlong_buffer: int | None = Field(
        None, ge=1, description="length: the tokens before max_completion_length over which the penalty grows to -1."
    )
    url: str | None = Field(
        None,
        max_length=HTTP_REWARD_MAX_URL,
        description="http: the reward service's URL (https; a private or reserved address only where an admin lists "
        "the host in webhook_allowed_hosts).",
    )
    timeout_s: float = Field(10.0, gt=0, le=300, description="http: seconds one POST may take.")
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="http: further tries of a failed batch (backoff 0.5 s, doubling); then it scores NaN.",
    )
    batch_size: int = Field(64, ge=1, le=4096, description="http: completions per POST.")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="http: set by the service at submission (whatever a submitter writes is replaced): the entries "
        "of the admin's webhook_allowed_hosts that let url reach a non-public address; the worker re-checks every "
        "address it connects to against them.",
    )

    @model_validator(mode="after")
    def _check_reward(self) -> RewardFunc:
        needs = {"regex": "pattern", "json_schema": "json_schema", "length": "overlong_buffer"}
        for name, field in needs.items():
            if self.name == name and getattr(self, field) is None:
                raise ValueError(f"{field}: reward {name} needs it")
            if self.name != name and getattr(self, field) is not None:
                raise ValueError(f"{field}: applies to reward {name} only, not {self.name}")
        if self.name == "http" and self.url is None:
            raise ValueError("url: reward http needs it")
        if self.name != "http" and self.model_fields_set & set(HTTP_REWARD_FIELDS):
            field = min(self.model_fields_set & set(HTTP_REWARD_FIELDS))
            raise ValueError(f"{field}: applies to reward http only, not {self.name}")
        if self.url is not None:
            net_rules.parse(
                self.url, HTTP_REWARD_MAX_URL
            )  # "url: ..." (the address is checked at submission and per POST)
        if self.pattern is not None:
            import regex  # type: ignore[import-untyped]

            try:
                regex.compile(self.pattern)
            except regex.error as err:
                raise ValueError(f"pattern: not a valid regular expression ({err})") from err
        if self.json_schema is not None:
            import jsonschema  # type: ignore[import-untyped]

            try:
                jsonschema.validators.validator_for(self.json_schema).check_schema(self.json_schema)
            except jsonschema.SchemaError as err:
                raise ValueError(f"json_schema: not a valid JSON Schema ({err.message})") from err
        return self

    @property
    def key(self) -> str:
        return self.label or self.name
