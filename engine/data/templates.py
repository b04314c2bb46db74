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
user/observation then assistant/function. A ``tools`` message right after the optional system message carries the tool
definitions (a JSON list, bare function definitions or ``{"type": "function", "function": ...}``; ``parse_tools``).
``qwen3`` and ``hf`` render them exactly as Qwen3's chat template does with ``apply_chat_template(..., tools=...)``:
one system turn holding the system prompt, a blank line, then the ``# Tools`` block with one JSON definition per line
(``json.dumps(ensure_ascii=False)``, the template's ``tojson``).

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
  A thought is recognised only in MindSpeed's spelling, its ``thought_words`` ``<think>\\n`` and ``\\n</think>\\n\\n``
  (``ReasoningTemplate.encode_multiturn`` tests ``thought_words[0] in content or thought_words[1] in content``;
  ``remove_thought`` matches ``<think>\\n(.*?)\\n</think>\\n\\n``): markers without those newlines, e.g.
  ``<think>short</think>Answer.``, are plain text, so true/none add the empty thought and false keeps the block.
- ``qwen``: MindSpeed-LLM's ``qwen`` entry (``configs/finetune/templates.json``, the older ``Template`` class, no
  thinking rules: ``enable_thinking`` is ignored): the system turn is always there, with the default system prompt
  ``You are a helpful assistant.`` when the data has none; an answer ends with the eos token, ``<|im_end|>``, and no
  newline (``default_assistant_formatter`` + ``replace_eos``); a ``\\n`` separator (masked) precedes every prompt turn
  after the first; a tool result is a ``<|im_start|>tool\\n…<|im_end|>\\n`` turn; a function call is
  ``Action: name\\nAction Input: {arguments JSON}`` + eos (``FunctionFormatter``) and tools go into the system prompt
  in LLaMA-Factory's ``default_tool_formatter`` text (``mindspeed_llm/tasks/preprocess/formatter.py``). One function
  call per turn: MindSpeed's formatter writes an empty call for a list, so parallel calls are refused here.
- ``hf``: the tokenizer's own ``chat_template`` via ``apply_chat_template``; the rendered text is tokenized in one piece
  (ids equal ``apply_chat_template(..., tokenize=True)``) and assistant spans (from the generation header to the
  end-of-turn marker) are the trained tokens. ``enable_thinking`` true/false is passed to the template, none is not.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from engine.contract.constants import IGNORE_INDEX
from engine.contract.data_formats import TEMPLATES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ThinkingMode = Literal["true", "false", "none"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
EMPTY_THOUGHT = "<think>\n\n</think>\n\n"  # MindSpeed thought_words "<think>\n" + "\n</think>\n\n"
THOUGHT_WORDS = ("<think>\n", "\n</think>\n\n")  # MindSpeed _register_template default thought_words
_THOUGHT_RE = re.compile(f"{re.escape(THOUGHT_WORDS[0])}(.*?){re.escape(THOUGHT_WORDS[1])}", re.DOTALL)
_ROLE_ALIASES = {"tool": "observation", "function_call": "function", "human": "user", "gpt": "assistant"}
TOOLS_ROLE = "tools"  # a pseudo-message after the system prompt: the JSON list of tool definitions
# Qwen3's chat template text around the tool definitions (tokenizer_config.json "chat_template", tools branch).
QWEN3_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN3_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
_PROMPT_ROLES = ("user", "observation")
_RESPONSE_ROLES = ("assistant", "function")


class ConversationError(ValueError):
    """The conversation cannot be rendered (bad role order, empty, missing content). Message names the turn."""


# ---------------------------------------------------------------- validation


def normalize_thinking(mode: object) -> ThinkingMode:
    """Accept True/False/None or the strings true/false/none (any case)."""
    if mode is None:
        return "none"
    if isinstance(mode, bool):
        return "true" if mode else "false"
    text = str(mode).strip().lower()
    if text not in ("true", "false", "none"):
        raise ValueError(f"enable_thinking: must be true, false or none, not {mode!r}")
    return text  # type: ignore[return-value]


def parse_tools(value: object) -> list[dict[str, Any]]:
    """Tool definitions (a JSON string or a list) as ``[{"type": "function", "function": {...}}]``.

    A bare function definition is wrapped as MindSpeed's ``QwenToolUtils.tool_formatter`` and transformers' callers
    do; an empty string or list means no tools. Raises ``ConversationError``."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConversationError(f"tools: not valid JSON: {err.msg} at character {err.pos}") from err
    tools = value if isinstance(value, list) else [value]
    checked: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None  # {"function": "x"} is refused too
        if not isinstance(tool, dict) or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ConversationError(f"tools: entry {i} must be an object with a name (a function definition)")
        checked.append(tool if tool.get("type") == "function" else {"type": "function", "function": tool})
    return checked


def check_conversation(messages: Sequence[dict[str, Any]], need_response: bool = True) -> list[dict[str, str]]:
    """Validate and normalize roles; returns a new list of ``{"role", "content"}``. Raises ``ConversationError``.

    A ``tools`` message (content: JSON list of tool definitions, or the list itself) may follow the optional system
    message; it comes out as canonical JSON of the wrapped definitions, or is left out when the list is empty."""
    if not messages:
        raise ConversationError("empty conversation")
    out: list[dict[str, str]] = []
    turn = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConversationError(f"turn {i}: expected an object with role and content, got {type(message).__name__}")
        role = _ROLE_ALIASES.get(str(message.get("role")), message.get("role"))
        content = message.get("content")
        if role == TOOLS_ROLE and turn == 0 and all(m["role"] == "system" for m in out):
            tools = parse_tools(content)
            if tools:
                out.append({"role": TOOLS_ROLE, "content": json.dumps(tools, ensure_ascii=False)})
            continue
        if not isinstance(content, str):
            raise ConversationError(f"turn {i}: content must be a string, got {type(content).__name__}")
        if role == "system" and i == 0:
            out.append({"role": "system", "content": content})
            continue
        expected = _PROMPT_ROLES if turn % 2 == 0 else _RESPONSE_ROLES
        if role not in _PROMPT_ROLES + _RESPONSE_ROLES + ("system",):
            raise ConversationError(f"turn {i}: unknown role {message.get('role')!r}")
        if role not in expected:
            raise ConversationError(f"turn {i}: role {role!r} where {' or '.join(expected)} was expected")
        out.append({"role": role, "content": content})
        turn += 1
    if turn == 0:
        raise ConversationError("conversation has only a system message")
    if need_response and turn % 2:
        raise ConversationError("conversation must end with an assistant turn")
    return out


def _split_turns(
    messages: list[dict[str, str]],
) -> tuple[str | None, str | None, list[tuple[dict[str, str], dict[str, str] | None]]]:
    """(system, tools JSON, [(prompt turn, response turn or None)])."""
    head = {m["role"]: m["content"] for m in messages[:2] if m["role"] in ("system", TOOLS_ROLE)}
    body = messages[len(head) :]
    pairs = [(body[i], body[i + 1] if i + 1 < len(body) else None) for i in range(0, len(body), 2)]
    return head.get("system"), head.get(TOOLS_ROLE), pairs


# ---------------------------------------------------------------- ChatML (qwen3, qwen)


def remove_thought(content: str) -> str:
    """Drop every ``<think>\\n…\\n</think>\\n\\n`` block and the newlines after it (MindSpeed's ``remove_thought``)."""
    return _THOUGHT_RE.sub("", content).lstrip("\n")


def _has_thought(content: str) -> bool:
    return THOUGHT_WORDS[0] in content or THOUGHT_WORDS[1] in content


def _parse_calls(content: str) -> list[dict[str, Any]]:
    """``[{"name", "arguments"}]`` from a function-call turn (one JSON object or a list; arguments may be a JSON string)."""
    try:
        calls = json.loads(content)
        calls = calls if isinstance(calls, list) else [calls]
        if not all(isinstance(c, dict) and "name" in c and "arguments" in c for c in calls):
            raise ConversationError("function call must be JSON with name and arguments")
        return [
            {
                "name": c["name"],
                "arguments": json.loads(c["arguments"]) if isinstance(c["arguments"], str) else c["arguments"],
            }
            for c in calls
        ]
    except json.JSONDecodeError as err:
        raise ConversationError(f"function call content is not JSON: {err.msg}") from err


def _tool_calls(content: str) -> str:
    texts = [json.dumps(call, ensure_ascii=False) for call in _parse_calls(content)]
    return "\n".join(f"<tool_call>\n{t}\n</tool_call>" for t in texts)


def _qwen3_tools_system(system: str | None, tools: str) -> str:
    """The system turn's text with tools, as Qwen3's chat template writes it (system prompt, blank line, # Tools)."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in json.loads(tools))
    return ("" if system is None else system + "\n\n") + QWEN3_TOOLS_HEAD + lines + QWEN3_TOOLS_TAIL


def _prompt_text(message: dict[str, str]) -> str:
    if message["role"] == "observation":
        return f"{IM_START}user\n<tool_response>\n{message['content']}\n</tool_response>{IM_END}\n{IM_START}assistant\n"
    return f"{IM_START}user\n{message['content']}{IM_END}\n{IM_START}assistant\n"


def _response_text(message: dict[str, str]) -> str:
    content = _tool_calls(message["content"]) if message["role"] == "function" else message["content"]
    return f"{content}{IM_END}\n"


def _chatml_head(system: str | None, tools: str | None) -> list[tuple[str, bool]]:
    if tools is not None:
        return [(f"{IM_START}system\n{_qwen3_tools_system(system, tools)}{IM_END}\n", False)]
    return [] if system is None else [(f"{IM_START}system\n{system}{IM_END}\n", False)]


def chatml_segments(
    messages: list[dict[str, str]], reasoning: bool, thinking: ThinkingMode, generation: bool = False
) -> list[tuple[str, bool]]:
    """The pieces MindSpeed tokenizes one by one, each with "is trained" (``messages`` already checked).

    With ``generation`` the conversation ends with a prompt and the result is the generation prompt.
    """
    system, tools, pairs = _split_turns(messages)
    segments = _chatml_head(system, tools)
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


# ---------------------------------------------------------------- qwen (MindSpeed's older ChatML template)

QWEN_DEFAULT_SYSTEM = "You are a helpful assistant."
_QWEN_TOOL_PROMPT = (
    "You have access to the following tools:\n{tool_text}Use the following format if using a tool:\n```\n"
    "Action: tool name (one of [{tool_names}]).\nAction Input: the input to the tool{format_prompt}.\n```\n"
)
_QWEN_JSON_FORMAT = ', in a JSON format representing the kwargs (e.g. ```{"input": "hello world", "num_beams": 5}```)'


def _qwen_param_line(name: str, param: dict[str, Any], required: list[str]) -> str:
    enum = f", should be one of [{', '.join(param['enum'])}]" if param.get("enum") else ""
    items = f", where each item should be {param['items'].get('type', '')}" if param.get("items") else ""
    flag = ", required" if name in required else ""
    return f"  - {name} ({param.get('type', '')}{flag}): {param.get('description', '')}{enum}{items}\n"


def _qwen_tool_text(tools: str) -> str:
    """LLaMA-Factory's ``default_tool_formatter`` text, which MindSpeed's ``qwen`` appends to the system prompt."""
    functions = [t["function"] for t in json.loads(tools)]
    text = ""
    for fn in functions:
        params = fn.get("parameters") or {}
        args = "".join(
            _qwen_param_line(n, p, params.get("required", [])) for n, p in params.get("properties", {}).items()
        )
        text += f"> Tool Name: {fn['name']}\nTool Description: {fn.get('description', '')}\nTool Args:\n{args}\n"
    names = ", ".join(fn["name"] for fn in functions)
    return _QWEN_TOOL_PROMPT.format(tool_text=text, tool_names=names, format_prompt=_QWEN_JSON_FORMAT)


def _qwen_action(content: str) -> str:
    try:
        call = json.loads(content)
    except json.JSONDecodeError as err:
        raise ConversationError(f"function call content is not JSON: {err.msg}") from err
    if isinstance(call, list):
        raise ConversationError(
            "template qwen: one function call per turn (MindSpeed's qwen writes no parallel calls); use qwen3 or hf"
        )
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        raise ConversationError("function call must be JSON with name and arguments")
    return f"Action: {call['name']}\nAction Input: {json.dumps(call['arguments'], ensure_ascii=False)}"


def qwen_segments(messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """MindSpeed ``qwen``'s pieces, each with "is trained" (see the module docstring)."""
    system, tools, pairs = _split_turns(messages)
    system_text = (system or QWEN_DEFAULT_SYSTEM) + (_qwen_tool_text(tools) if tools else "")
    segments = [(f"{IM_START}system\n{system_text}{IM_END}\n", False)]
    for k, (prompt, response) in enumerate(pairs):
        if k:
            segments.append(("\n", False))
        role = "tool" if prompt["role"] == "observation" else "user"
        segments.append((f"{IM_START}{role}\n{prompt['content']}{IM_END}\n{IM_START}assistant\n", False))
        if response is None:
            break
        content = _qwen_action(response["content"]) if response["role"] == "function" else response["content"]
        segments.append((content + IM_END, True))
    return segments


def _segments(
    name: str, messages: list[dict[str, str]], thinking: ThinkingMode, generation: bool = False
) -> list[tuple[str, bool]]:
    if name == "qwen":
        return qwen_segments(messages)  # a trailing prompt turn already ends with the assistant header
    return chatml_segments(messages, reasoning=True, thinking=thinking, generation=generation)


def _assemble(segments: list[tuple[str, bool]], ids_of: dict[str, list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ids: list[int] = []
    labels: list[int] = []
    for text, train in segments:
        piece = ids_of[text]
        ids.extend(piece)
        labels.extend(piece if train else [IGNORE_INDEX] * len(piece))
    return np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32)


def _tokenize_unique(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> dict[str, list[int]]:
    """One batched fast-tokenizer call over the distinct pieces (system prompts repeat across a dataset)."""
    unique = list(dict.fromkeys(texts))
    encoded = tokenizer(unique, add_special_tokens=False)["input_ids"] if unique else []
    return dict(zip(unique, encoded, strict=True))


# ---------------------------------------------------------------- hf (the tokenizer's chat template)


def _hf_tools(messages: list[dict[str, str]]) -> dict[str, Any]:
    """``tools=`` for ``apply_chat_template`` (the wrapped definitions), or nothing."""
    tools = [json.loads(m["content"]) for m in messages[:2] if m["role"] == TOOLS_ROLE]
    return {"tools": tools[0]} if tools else {}


def _hf_messages(messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == TOOLS_ROLE:
            continue
        if m["role"] == "observation":
            out.append({"role": "tool", "content": m["content"]})
        elif m["role"] == "function":
            calls = _parse_calls(m["content"])
            out.append(
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c} for c in calls]}
            )
        else:
            out.append(dict(m))
    return out


def _hf_kwargs(thinking: ThinkingMode, messages: list[dict[str, str]]) -> dict[str, Any]:
    return {**_hf_tools(messages), **({} if thinking == "none" else {"enable_thinking": thinking == "true"})}


def _hf_render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    generation: bool,
    **kwargs: Any,  # Any: the chat template's own variables (tools, enable_thinking), as transformers types them
) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConversationError("template hf: the tokenizer has no chat_template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kwargs)
    assert isinstance(text, str)  # tokenize=False: the rendered text
    return text


_TURN_END: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _hf_turn_end(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text the template writes after an assistant message (e.g. ``<|im_end|>\\n``), found with a sentinel."""
    if tokenizer not in _TURN_END:
        sentinel = "\x1fLLMJOBS\x1f"
        text = _hf_render(
            tokenizer, [{"role": "user", "content": "u"}, {"role": "assistant", "content": sentinel}], False
        )
        _TURN_END[tokenizer] = text.split(sentinel)[-1] or (tokenizer.eos_token or "")
    return _TURN_END[tokenizer]


def _hf_encode(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], thinking: ThinkingMode
) -> tuple[np.ndarray, np.ndarray]:
    hf_msgs = _hf_messages(messages)
    kwargs = _hf_kwargs(thinking, messages)
    text = _hf_render(tokenizer, hf_msgs, False, **kwargs)
    end_marker = _hf_turn_end(tokenizer)
    spans = []
    for i, m in enumerate(hf_msgs):
        if m["role"] != "assistant":
            continue
        # The generation header with the thinking flag (qwen3 false: ends with the empty thought, which stays masked);
        # when the template renders this turn differently (e.g. no thought on earlier turns), the plain header.
        heads = [
            _hf_render(tokenizer, hf_msgs[:i], True, **kwargs),
            _hf_render(tokenizer, hf_msgs[:i], True, **_hf_tools(messages)),
        ]
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
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Sequence[dict[str, Any]]],
    template: str,
    enable_thinking: object = "none",
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batch form of ``encode_conversation``. Raises ``ConversationError`` naming the first bad conversation's turn."""
    name, thinking = _check_template(template), normalize_thinking(enable_thinking)
    checked = [check_conversation(c) for c in conversations]
    if name == "hf":
        return [_hf_encode(tokenizer, c, thinking) for c in checked]
    segments = [_segments(name, c, thinking) for c in checked]
    ids_of = _tokenize_unique(tokenizer, (text for segs in segments for text, _ in segs))
    return [_assemble(segs, ids_of) for segs in segments]


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    template: str,
    enable_thinking: object = "none",
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and labels (-100 on every non-assistant token) of one conversation; see the module docstring."""
    return encode_conversations(tokenizer, [messages], template, enable_thinking)[0]


def _qwen3_oneturn(messages: list[dict[str, str]], thinking: ThinkingMode) -> list[tuple[str, bool]]:
    """MindSpeed ``ReasoningTemplate.encode_oneturn``: earlier answers lose their thoughts and get no empty thought;
    only the last answer (trained) follows the enable_thinking rule."""
    system, tools, pairs = _split_turns(messages)
    segments = _chatml_head(system, tools)
    for k, (prompt, response) in enumerate(pairs):
        assert response is not None  # checked: the conversation ends with the answer
        last = k == len(pairs) - 1
        content = remove_thought(response["content"]) if not last or thinking == "false" else response["content"]
        segments.append((_prompt_text(prompt), False))
        if last and not _has_thought(content):
            segments.append((EMPTY_THOUGHT, thinking == "true"))
        segments.append((_response_text({**response, "content": content}), last))
    return segments


def encode_pair(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Sequence[dict[str, Any]],
    chosen: dict[str, Any],
    rejected: dict[str, Any],
    template: str,
    enable_thinking: object = "none",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt ids, chosen answer ids, rejected answer ids) of a preference pair, as MindSpeed's pairwise handlers
    encode it (``data_handler.py::AlpacaStylePairwiseHandler._filter``, ``Template.encode_oneturn``): the prompt is
    the one computed with the chosen answer (qwen3: it ends with the masked empty thought when the chosen answer has
    no thought and enable_thinking is not true), each answer is its last turn (with the empty thought in front in
    ``true`` mode). ``hf`` (no MindSpeed counterpart): the tokenizer's template, the prompt being everything before
    the last assistant turn."""
    name, thinking = _check_template(template), normalize_thinking(enable_thinking)
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for answer in (chosen, rejected):
        conversation = check_conversation([*prompt, answer])
        if name == "hf":
            ids, labels = _hf_encode(tokenizer, conversation, thinking)
            trained = labels != IGNORE_INDEX
            start = int(np.flatnonzero(trained & ~np.concatenate(([False], trained[:-1])))[-1])  # last answer
            out.append((ids[:start], ids[start:]))
            continue
        if name == "qwen":
            segments = qwen_segments(conversation)
            segments = [(text, trained and i == len(segments) - 1) for i, (text, trained) in enumerate(segments)]
        else:
            segments = _qwen3_oneturn(conversation, thinking)
        ids, labels = _assemble(segments, _tokenize_unique(tokenizer, (text for text, _ in segments)))
        first = int(np.flatnonzero(labels != IGNORE_INDEX)[0])
        out.append((ids[:first], ids[first:]))
    return out[0][0], out[0][1], out[1][1]


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    template: str,
    enable_thinking: object = "none",
) -> list[int]:
    """Prompt ids for generating the next assistant turn (a trailing assistant turn is dropped first)."""
    name, thinking = _check_template(template), normalize_thinking(enable_thinking)
    msgs = list(messages)
    role = str(msgs[-1].get("role")) if msgs else ""
    if msgs and _ROLE_ALIASES.get(role, role) in _RESPONSE_ROLES:
        msgs = msgs[:-1]
    checked = check_conversation(msgs, need_response=False)  # alternation => it now ends with a user/observation turn
    if name == "hf":
        text = _hf_render(tokenizer, _hf_messages(checked), True, **_hf_kwargs(thinking, checked))
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    segments = _segments(name, checked, thinking, generation=True)
    ids_of = _tokenize_unique(tokenizer, (text for text, _ in segments))
    return _assemble(segments, ids_of)[0].tolist()
