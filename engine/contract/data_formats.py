"""The data formats preprocessing reads, by name: MindSpeed's handler names, ``map_keys`` and chat template names.

Torch-free and small so that a spec is checked at submission exactly as preprocessing will read it
(``engine.data.formats`` converts records, ``engine.data.templates`` renders them).
"""

from __future__ import annotations

from typing import Any

TEMPLATES = ("qwen3", "qwen", "hf")  # prompt_type values: engine.data.templates renders each

HANDLERS: dict[str, str] = {
    "SharegptStyleInstructionHandler": "sharegpt",
    "AlpacaStyleInstructionHandler": "alpaca",
    "GeneralInstructionHandler": "alpaca",
    "GeneralPretrainHandler": "text",
    "SharegptStylePairwiseHandler": "sharegpt",
    "AlpacaStylePairwiseHandler": "alpaca",
    "": "text",
}
PAIRWISE_HANDLERS = ("SharegptStylePairwiseHandler", "AlpacaStylePairwiseHandler")
SHAREGPT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
OPENAI_TAGS = {
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "tool",
    "function_tag": "function_call",
    "system_tag": "system",
}
OPENAI_PREFERENCE_KEYS = frozenset({"input", "preferred_output", "non_preferred_output"})
_SHAREGPT_KEYS = {"messages", "system", "tools", "tags"}
_ALPACA_KEYS = {"prompt", "query", "response", "system", "history"}


def handler_format(handler_name: str | None) -> str:
    """``sharegpt``, ``alpaca`` or ``text`` for a MindSpeed handler name; ``ValueError`` for an unsupported one."""
    name = handler_name or ""
    if name not in HANDLERS:
        raise ValueError(f"handler_name: {name!r} is not supported; use one of {', '.join(h for h in HANDLERS if h)}")
    return HANDLERS[name]


def check_map_keys(fmt: str, map_keys: dict[str, Any], pairwise: bool = False) -> None:
    """``ValueError`` naming ``map_keys`` for a key or tag the format (``sharegpt`` / ``alpaca``) does not read."""
    allowed = (_SHAREGPT_KEYS if fmt == "sharegpt" else _ALPACA_KEYS) | ({"chosen", "rejected"} if pairwise else set())
    unknown = sorted(set(map_keys) - allowed)
    if unknown:
        raise ValueError(
            f"map_keys: unknown key(s) {', '.join(map(repr, unknown))} for {fmt}; allowed: {', '.join(sorted(allowed))}"
        )
    tags = map_keys.get("tags", {})
    if not isinstance(tags, dict) or set(tags) - set(SHAREGPT_TAGS):
        raise ValueError(f"map_keys: tags must be an object with keys among {', '.join(SHAREGPT_TAGS)}")
