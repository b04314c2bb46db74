"""Chat templates: a conversation -> token ids and labels (training) or prompt ids (generation).

Public interface (shared with evaluation; names are stable):

- ``encode_conversation(tokenizer, messages, template, enable_thinking) -> (input_ids, labels)``: numpy int32 arrays of
  equal length; ``labels`` equals ``input_ids`` on tokens the model is trained on (every assistant turn, its end-of-turn
  marker included) and ``IGNORE_INDEX`` (-100) everywhere else. Labels are token-aligned, not shifted: the trainer
  shifts (drops the first label and the last logit), as MindSpeed does with ``--is-instruction-dataset``.
- ``encode_conversations(tokenizer, conversations, template, enable_thinking)``: the same for a batch, tokenizing with
  one batched fast-tokenizer call (what the preprocessing workers use).
- ``encode_prompt(tokenizer, messages, template, enable_thinking) -> list[int]``: the prompt for generation: the
  conversation up to its last user turn (a trailing assistant turn, e.g. the reference answer, is dropped), then the
  assistant header, plus the empty thought ``<think>\\n\\n</think>\\n\\n`` when the template's thinking mode puts it in
  the prompt (qwen3 with enable_thinking false/none), so generation sees what training saw.

``messages`` is a list of ``{"role", "content"}`` with roles ``system`` (first only), ``user``, ``assistant``,
``observation`` (alias ``tool``: a tool result) and ``function`` (alias ``function_call``: an assistant tool call whose
content is JSON ``{"name", "arguments"}`` or a list of them). After an optional system message, turns alternate
user/observation then assistant/function.

Templates (``template`` argument; ``TEMPLATES`` lists them):

- ``qwen3``: MindSpeed-LLM's ``qwen3`` entry (``configs/finetune/templates.json``, class ``ReasoningTemplate``): ChatML,
  ``<|im_end|>`` ends a turn, no default system. Every piece (system, user turn + assistant header, assistant turn,
  empty thought) is tokenized on its own without special tokens and the ids are concatenated, as MindSpeed does.
  ``enable_thinking`` (``"true"``/``"false"``/``"none"`` or True/False/None), per assistant turn:

  ====== ============================================ ==================================================
  mode   response already has ``<think>…</think>``    response without think tags
  ====== ============================================ ==================================================
  true   kept, trained                                empty thought prepended to the response, trained
  false  stripped (and the newlines after it)         empty thought appended to the prompt, masked
  none   kept, trained                                empty thought appended to the prompt, masked
  ====== ============================================ ==================================================

  Unlike transformers' Qwen3 chat template, true/none never strip reasoning from earlier turns and false/none put the
  empty thought before every assistant turn, not only after the last user query (MindSpeed's definition).
  ``false`` strips any ``<think>…</think>`` block; MindSpeed's regex only matches the canonical
  ``<think>\\n…\\n</think>\\n\\n`` spelling, which gives the same result on canonical data.
- ``qwen``: the same ChatML pieces without the thinking rules (``enable_thinking`` is ignored).
- ``hf``: the tokenizer's own ``chat_template`` via ``apply_chat_template``; the rendered text is tokenized in one piece
  (ids equal ``apply_chat_template(..., tokenize=True)``) and assistant spans (from the generation header to the
  end-of-turn marker) are the trained tokens. ``enable_thinking`` true/false is passed to the template, none is not.
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any, Iterable, Literal, Sequence

import numpy as np

IGNORE_INDEX = -100
TEMPLATES = ("qwen3", "qwen", "hf")
ThinkingMode = Literal["true", "false", "none"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
EMPTY_THOUGHT = "<think>\n\n</think>\n\n"  # MindSpeed thought_words "<think>\n" + "\n</think>\n\n"
_THOUGHT_RE = re.compile(r"<think>.*?</think>", re.DOTALL)
_ROLE_ALIASES = {"tool": "observation", "function_call": "function", "human": "user", "gpt": "assistant"}
_PROMPT_ROLES = ("user", "observation")
_RESPONSE_ROLES = ("assistant", "function")


class ConversationError(ValueError):
    """The conversation cannot be rendered (bad role order, empty, missing content). Message names the turn."""


# ---------------------------------------------------------------- validation


def normalize_thinking(mode: Any) -> ThinkingMode:
    """Accept True/False/None or the strings true/false/none (any case)."""
    if mode is None:
        return "none"
    if isinstance(mode, bool):
        return "true" if mode else "false"
    text = str(mode).strip().lower()
    if text not in ("true", "false", "none"):
        raise ValueError(f"enable_thinking: must be true, false or none, not {mode!r}")
    return text  # type: ignore[return-value]


def check_conversation(messages: Sequence[dict[str, Any]], need_response: bool = True) -> list[dict[str, str]]:
    """Validate and normalize roles; returns a new list of ``{"role", "content"}``. Raises ``ConversationError``."""
    if not messages:
        raise ConversationError("empty conversation")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConversationError(f"turn {i}: expected an object with role and content, got {type(message).__name__}")
        role = _ROLE_ALIASES.get(str(message.get("role")), message.get("role"))
        content = message.get("content")
        if not isinstance(content, str):
            raise ConversationError(f"turn {i}: content must be a string, got {type(content).__name__}")
        if role == "system" and i == 0:
            out.append({"role": "system", "content": content})
            continue
        turn = i - (1 if out and out[0]["role"] == "system" else 0)
        expected = _PROMPT_ROLES if turn % 2 == 0 else _RESPONSE_ROLES
        if role not in _PROMPT_ROLES + _RESPONSE_ROLES + ("system",):
            raise ConversationError(f"turn {i}: unknown role {message.get('role')!r}")
        if role not in expected:
            raise ConversationError(f"turn {i}: role {role!r} where {' or '.join(expected)} was expected")
        out.append({"role": role, "content": content})
    body = len(out) - (1 if out[0]["role"] == "system" else 0)
    if body == 0:
        raise ConversationError("conversation has only a system message")
    if need_response and body % 2:
        raise ConversationError("conversation must end with an assistant turn")
    return out


def _split_turns(messages: list[dict[str, str]]) -> tuple[str | None, list[tuple[dict[str, str], dict[str, str] | None]]]:
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    body = messages[1:] if system is not None else messages
    pairs = [(body[i], body[i + 1] if i + 1 < len(body) else None) for i in range(0, len(body), 2)]
    return system, pairs


# ---------------------------------------------------------------- ChatML (qwen3, qwen)


def remove_thought(content: str) -> str:
    """Drop every ``<think>…</think>`` block and the newlines that follow it (MindSpeed's ``remove_thought``)."""
    return _THOUGHT_RE.sub("", content).lstrip("\n")


def _has_thought(content: str) -> bool:
    return "<think>" in content or "</think>" in content


def _parse_calls(content: str) -> list[dict[str, Any]]:
    """``[{"name", "arguments"}]`` from a function-call turn (one JSON object or a list; arguments may be a JSON string)."""
    try:
        calls = json.loads(content)
        calls = calls if isinstance(calls, list) else [calls]
        if not all(isinstance(c, dict) and "name" in c and "arguments" in c for c in calls):
            raise ConversationError("function call must be JSON with name and arguments")
        return [{"name": c["name"], "arguments": json.loads(c["arguments"]) if isinstance(c["arguments"], str) else c["arguments"]}
                for c in calls]
    except json.JSONDecodeError as err:
        raise ConversationError(f"function call content is not JSON: {err.msg}") from err


def _tool_calls(content: str) -> str:
    texts = [json.dumps(call, ensure_ascii=False) for call in _parse_calls(content)]
    return "\n".join(f"<tool_call>\n{t}\n</tool_call>" for t in texts)


def _prompt_text(message: dict[str, str]) -> str:
    if message["role"] == "observation":
        return f"{IM_START}user\n<tool_response>\n{message['content']}\n</tool_response>{IM_END}\n{IM_START}assistant\n"
    return f"{IM_START}user\n{message['content']}{IM_END}\n{IM_START}assistant\n"


def _response_text(message: dict[str, str]) -> str:
    content = _tool_calls(message["content"]) if message["role"] == "function" else message["content"]
    return f"{content}{IM_END}\n"


def chatml_segments(
    messages: list[dict[str, str]], reasoning: bool, thinking: ThinkingMode, generation: bool = False
) -> list[tuple[str, bool]]:
    """The pieces MindSpeed tokenizes one by one, each with "is trained" (``messages`` already checked).

    With ``generation`` the conversation ends with a prompt and the result is the generation prompt.
    """
    system, pairs = _split_turns(messages)
    segments: list[tuple[str, bool]] = []
    if system is not None:
        segments.append((f"{IM_START}system\n{system}{IM_END}\n", False))
    for prompt, response in pairs:
        segments.append((_prompt_text(prompt), False))
        if response is None and not generation:
            break
        content = response["content"] if response is not None else ""
        if reasoning and thinking == "false" and response is not None:
            response = {**response, "content": remove_thought(content)}
            content = response["content"]
        thought_in_prompt = reasoning and thinking != "true" and (response is None or not _has_thought(content))
        thought_in_response = reasoning and thinking == "true" and response is not None and not _has_thought(content)
        if thought_in_prompt:
            segments.append((EMPTY_THOUGHT, False))
        if thought_in_response:
            segments.append((EMPTY_THOUGHT, True))
        if response is not None:
            segments.append((_response_text(response), True))
    return segments


def _assemble(segments: list[tuple[str, bool]], ids_of: dict[str, list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ids: list[int] = []
    labels: list[int] = []
    for text, train in segments:
        piece = ids_of[text]
        ids.extend(piece)
        labels.extend(piece if train else [IGNORE_INDEX] * len(piece))
    return np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32)


def _tokenize_unique(tokenizer: Any, texts: Iterable[str]) -> dict[str, list[int]]:
    """One batched fast-tokenizer call over the distinct pieces (system prompts repeat across a dataset)."""
    unique = list(dict.fromkeys(texts))
    encoded = tokenizer(unique, add_special_tokens=False)["input_ids"] if unique else []
    return dict(zip(unique, encoded))


# ---------------------------------------------------------------- hf (the tokenizer's chat template)


def _hf_messages(messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "observation":
            out.append({"role": "tool", "content": m["content"]})
        elif m["role"] == "function":
            calls = _parse_calls(m["content"])
            out.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c} for c in calls]})
        else:
            out.append(dict(m))
    return out


def _hf_kwargs(thinking: ThinkingMode) -> dict[str, Any]:
    return {} if thinking == "none" else {"enable_thinking": thinking == "true"}


def _hf_render(tokenizer: Any, messages: list[dict[str, Any]], generation: bool, **kwargs: Any) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConversationError("template hf: the tokenizer has no chat_template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kwargs)


_TURN_END: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _hf_turn_end(tokenizer: Any) -> str:
    """The text the template writes after an assistant message (e.g. ``<|im_end|>\\n``), found with a sentinel."""
    if tokenizer not in _TURN_END:
        sentinel = "\x1fLLMJOBS\x1f"
        text = _hf_render(tokenizer, [{"role": "user", "content": "u"}, {"role": "assistant", "content": sentinel}], False)
        _TURN_END[tokenizer] = text.split(sentinel)[-1] or (tokenizer.eos_token or "")
    return _TURN_END[tokenizer]


def _hf_encode(tokenizer: Any, messages: list[dict[str, str]], thinking: ThinkingMode) -> tuple[np.ndarray, np.ndarray]:
    hf_msgs = _hf_messages(messages)
    kwargs = _hf_kwargs(thinking)
    text = _hf_render(tokenizer, hf_msgs, False, **kwargs)
    end_marker = _hf_turn_end(tokenizer)
    spans = []
    for i, m in enumerate(hf_msgs):
        if m["role"] != "assistant":
            continue
        # The generation header with the thinking flag (qwen3 false: ends with the empty thought, which stays masked);
        # when the template renders this turn differently (e.g. no thought on earlier turns), the plain header.
        heads = [_hf_render(tokenizer, hf_msgs[:i], True, **kwargs), _hf_render(tokenizer, hf_msgs[:i], True)]
        start = max((len(h) for h in heads if text.startswith(h)), default=None)
        if start is None:
            raise ConversationError(f"template hf: cannot locate assistant turn {i} in the rendered text")
        end = text.find(end_marker, start) if end_marker else -1
        spans.append((start, len(text) if end < 0 else end + len(end_marker)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    starts = np.asarray([o[0] for o in enc["offset_mapping"]], dtype=np.int64)
    trained = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        trained |= (starts >= a) & (starts < b)
    return ids, np.where(trained, ids, IGNORE_INDEX).astype(np.int32)


# ---------------------------------------------------------------- public API


def _check_template(template: str) -> str:
    name = (template or "").lower()
    if name not in TEMPLATES:
        raise ValueError(f"prompt_type: unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")
    return name


def encode_conversations(
    tokenizer: Any, conversations: Sequence[Sequence[dict[str, Any]]], template: str, enable_thinking: Any = "none"
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batch form of ``encode_conversation``. Raises ``ConversationError`` naming the first bad conversation's turn."""
    name, thinking = _check_template(template), normalize_thinking(enable_thinking)
    checked = [check_conversation(c) for c in conversations]
    if name == "hf":
        return [_hf_encode(tokenizer, c, thinking) for c in checked]
    segments = [chatml_segments(c, reasoning=name == "qwen3", thinking=thinking) for c in checked]
    ids_of = _tokenize_unique(tokenizer, (text for segs in segments for text, _ in segs))
    return [_assemble(segs, ids_of) for segs in segments]


def encode_conversation(
    tokenizer: Any, messages: Sequence[dict[str, Any]], template: str, enable_thinking: Any = "none"
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and labels (-100 on every non-assistant token) of one conversation; see the module docstring."""
    return encode_conversations(tokenizer, [messages], template, enable_thinking)[0]


def encode_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]], template: str, enable_thinking: Any = "none") -> list[int]:
    """Prompt ids for generating the next assistant turn (a trailing assistant turn is dropped first)."""
    name, thinking = _check_template(template), normalize_thinking(enable_thinking)
    msgs = list(messages)
    if msgs and _ROLE_ALIASES.get(msgs[-1].get("role"), msgs[-1].get("role")) in _RESPONSE_ROLES:
        msgs = msgs[:-1]
    checked = check_conversation(msgs, need_response=False)  # alternation => it now ends with a user/observation turn
    if name == "hf":
        text = _hf_render(tokenizer, _hf_messages(checked), True, **_hf_kwargs(thinking))
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    segments = chatml_segments(checked, reasoning=name == "qwen3", thinking=thinking, generation=True)
    ids_of = _tokenize_unique(tokenizer, (text for text, _ in segments))
    return _assemble(segments, ids_of)[0].tolist()
