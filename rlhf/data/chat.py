"""Conversational rows: recognising them, rendering them with a chat template, and masking the loss exactly.

A conversational field is a list of ``{"role", "content"}`` messages (TRL's conversational format):

* SFT: ``{"messages": [system?, user, assistant, user, assistant, ...]}``, or ``{"prompt": [messages],
  "response": [assistant messages]}``;
* preference: ``{"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant messages]}``, or
  ``{"chosen": [whole conversation], "rejected": [whole conversation]}`` whose shared leading messages are the
  prompt (the "implicit prompt" form);
* RL prompts: ``{"prompt": [messages]}``, rendered with the generation prompt the model answers after.

(Every layout a trainer reads, text ones and those mixing a text prompt with conversations: :mod:`rlhf.data.layouts`.)

Tool use (OpenAI / TRL layout): an assistant message may carry ``"tool_calls": [{"type": "function", "function":
{"name": ..., "arguments": {...}}}]`` (arguments an object or a JSON string of one) beside, or instead of, its
``content``; a ``tool`` message holds a call's result (``tool_call_id`` / ``name`` optional). A row's tool schemas
(``data.tools_key``, a list of OpenAI function schemas or a JSON string of one) go to the template as ``tools``, for
the whole sequence and every prefix the mask is found with. A turn that only calls tools is trained on like any
other assistant turn: its rendered calls and end-of-turn token.

Each sequence is rendered once with the template and tokenized once, with character offsets. The loss mask comes
from those offsets: an assistant turn's characters run from the end of the conversation rendered up to that turn
with the generation prompt, to the end of the conversation rendered through that turn (its end-of-turn token
included, trailing whitespace not). No substring is re-tokenized, so the ids trained on are exactly the ids of
the rendered conversation, and the prompt ids are exactly what the model is given at generation time. A template
that rewrites earlier turns when later ones follow (it is not prefix-stable) cannot be masked this way; such a
row is refused with a message that says so.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from rlhf.config.schema import ConfigError

ROLES = ("system", "user", "assistant", "tool")
Messages = List[dict]
Tools = List[dict]  # OpenAI function schemas, the chat template's ``tools`` variable


class ChatTemplateError(ConfigError):
    """Conversational rows with no usable chat template (the message names ``data.chat_template``)."""


def check_messages(value: Any, field: str, *, assistant_only: bool = False) -> Messages:
    """Validate a conversational field and return it; ``ValueError`` names the field, the message index and what is
    wrong. An assistant message needs a non-empty ``content`` or non-empty ``tool_calls`` (:func:`check_tool_calls`);
    every other message a text ``content``."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {field!r} must be a non-empty list of messages, got {_kind(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"field {field!r}: message {i} must be an object with role and content, got {_kind(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"field {field!r}: message {i} has role {role!r}; valid roles: {', '.join(ROLES)}")
        if assistant_only and role != "assistant":
            raise ValueError(f"field {field!r}: message {i} has role {role!r}; completions hold assistant messages")
        _check_message(m, f"field {field!r}: message {i} ({role})")
    return value


def _check_message(m: dict, where: str) -> None:
    """One message's content and tool fields (its role already checked); ``where`` starts the error."""
    role, content, calls = m["role"], m.get("content"), m.get("tool_calls")
    if calls is not None and role != "assistant":
        raise ValueError(f"{where} has 'tool_calls'; only assistant messages call tools")
    if role == "assistant" and calls is not None:
        check_tool_calls(calls, where)
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{where} needs a text or null 'content' beside its tool calls, got {_kind(content)}")
        if calls or (content or "").strip():
            return
    elif not isinstance(content, str):
        raise ValueError(f"{where} needs a text 'content', got {_kind(content)}")
    if role == "assistant" and not (content or "").strip():  # else it trains on the end-of-turn token alone
        raise ValueError(f"{where} is empty (no content, no tool_calls): there is no answer to train on")
    for key in ("tool_call_id", "name") if role == "tool" else ():
        if m.get(key) is not None and not isinstance(m[key], str):
            raise ValueError(f"{where}: {key!r} must be text, got {_kind(m[key])}")


def check_tool_calls(calls: Any, where: str) -> None:
    """An assistant's ``tool_calls`` (OpenAI / TRL layout): a list of ``{"type": "function", "id": ..., "function":
    {"name": str, "arguments": object or JSON-object string}}`` (``id`` and ``type`` optional).

    Raises:
        ValueError: Naming ``where`` (the field and message), the call's index and what is wrong.
    """
    if not isinstance(calls, list):
        raise ValueError(f"{where}: 'tool_calls' must be a list of calls, got {_kind(calls)}")
    for j, call in enumerate(calls):
        at = f"{where}: tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ValueError(f"{at} must be an object with a 'function' object (name, arguments), got {_kind(call)}")
        if call.get("type", "function") != "function":
            raise ValueError(f"{at}: 'type' must be 'function', got {call.get('type')!r}")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise ValueError(f"{at}: 'id' must be text, got {_kind(call['id'])}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{at}: 'function.name' must be a non-empty string, got {_kind(fn.get('name'))}")
        if not isinstance(_arguments(fn.get("arguments")), dict):
            raise ValueError(
                f"{at}: 'function.arguments' must be an object or a JSON string of one, got "
                f"{_kind(fn.get('arguments'))} {str(fn.get('arguments'))[:40]!r}"
            )


def _arguments(value: Any) -> Any:
    """A call's arguments as an object when they are one or a JSON string of one; else ``value`` as it is."""
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(value)
    return value


def parse_tools(value: Any, field: str) -> Optional[List[dict]]:
    """A row's tool schemas (``data.tools_key``; TRL's ``tools`` column): a list of objects (OpenAI function
    schemas), or a JSON string of one -> the list; None for null.

    Raises:
        ValueError: Naming ``field`` and what is wrong.
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"field {field!r} is not valid JSON ({e.msg}, char {e.pos}); expected a list of tool schemas"
            ) from None
    if not isinstance(value, list):
        raise ValueError(
            f"field {field!r} must be a list of tool schemas (or a JSON string of one), got {_kind(value)}"
        )
    for j, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise ValueError(f"field {field!r}: tool {j} must be an object (a function schema), got {_kind(tool)}")
    return value


def row_tools(row: dict, tools_key: str) -> Optional[List[dict]]:
    """The tool schemas of ``row`` (its ``tools_key`` field), None when it has none or ``tools_key`` is ""."""
    return parse_tools(row.get(tools_key), tools_key) if tools_key else None


def for_template(messages: Messages) -> Messages:
    """``messages`` as chat templates expect them, and as vLLM's OpenAI server hands them over
    (``vllm/renderers/chat_utils.py``, ``_postprocess_messages``): a tool call's JSON-string arguments parsed into an
    object (templates write ``arguments | tojson``), an empty ``tool_calls`` list dropped. So a call renders the same
    whichever way a row spells its arguments, and the same as the serving engine renders it. Copies; no row changes."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            if calls:
                m["tool_calls"] = [_with_parsed_arguments(c) for c in calls]
        out.append(m)
    return out


def _with_parsed_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    return {**call, "function": {**fn, "arguments": _arguments(fn["arguments"])}}


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def split_implicit_prompt(chosen: Messages, rejected: Messages) -> Tuple[Messages, Messages, Messages]:
    """``(prompt, chosen completion, rejected completion)`` of two whole conversations sharing their first turns.

    Raises:
        ValueError: When the conversations share no leading message, or one of them has nothing after it.
    """
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and chosen[n - 1].get("role") == "assistant":  # the prompt ends before the answers differ
        n -= 1
    if n == 0:
        raise ValueError(
            "fields 'chosen' and 'rejected' are whole conversations but share no leading prompt "
            "messages; give the prompt separately (a 'prompt' field of messages)"
        )
    for name, conv in (("chosen", chosen), ("rejected", rejected)):
        if len(conv) == n:
            raise ValueError(f"field {name!r} has no messages after the shared prompt")
        check_messages(conv[n:], name, assistant_only=True)
    return chosen[:n], chosen[n:], rejected[n:]


@dataclass(frozen=True)
class Encoded:
    """One rendered and tokenized conversation: ``input_ids`` and ``loss_mask`` (1 on trained tokens)."""

    input_ids: Tuple[int, ...]
    loss_mask: Tuple[int, ...]


def load_template(setting: str) -> Optional[str]:
    """``data.chat_template`` -> template text to use instead of the tokenizer's, or None (``auto`` / ``none``)."""
    if setting in ("auto", "none"):
        return None
    if not os.path.isfile(setting):
        raise ChatTemplateError(f"data.chat_template: {setting!r} is not a file")
    with open(setting, encoding="utf-8") as f:
        return f.read()


class ChatFormatter:
    """Renders conversations with one chat template and tokenizes them with exact loss masks.

    Args:
        tokenizer: A *fast* HF tokenizer (offsets are needed for the masks).
        template: Template text; None uses the tokenizer's own ``chat_template``.
        setting: The ``data.chat_template`` value, for error messages.
    """

    def __init__(self, tokenizer, template: Optional[str] = None, setting: str = "auto") -> None:
        self.tokenizer, self.setting = tokenizer, setting
        self.template = template if template is not None else getattr(tokenizer, "chat_template", None)
        if setting == "none":
            raise ChatTemplateError(
                "the data has conversational rows (lists of messages) but data.chat_template=none; "
                "set data.chat_template=auto (the tokenizer's template) or a .jinja file"
            )
        if not self.template:
            raise ChatTemplateError(
                "the data has conversational rows (lists of messages) but the tokenizer has no "
                "chat template; set data.chat_template to a .jinja template file"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ChatTemplateError(
                "conversational rows need a fast tokenizer (tokenizer.json): the loss mask is "
                "derived from token offsets"
            )

    # ---------------------------------------------------------------------------------- rendering
    def render(self, messages: Messages, generation_prompt: bool = False, tools: Optional[Tools] = None) -> str:
        """The template's text of ``messages`` (:func:`for_template`), with the tool schemas ``tools`` (the
        template's ``tools`` variable; None: none) and, under ``generation_prompt``, the assistant turn's opening."""
        try:
            return self.tokenizer.apply_chat_template(
                for_template(messages),
                tools=tools,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as e:  # noqa: BLE001 - a Jinja error (e.g. "roles must alternate") is a data problem
            raise ValueError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") from None

    def prompt_ids(self, messages: Messages, tools: Optional[Tools] = None) -> List[int]:
        """Token ids of ``messages`` (with the tool schemas ``tools``) followed by the generation prompt: what the
        model answers after, and what an OpenAI request with these messages and tools renders to."""
        return self.tokenize(self.render(messages, generation_prompt=True, tools=tools))

    def tokenize(self, rendered: str) -> List[int]:
        """Token ids of text this template rendered (no special tokens added: the template wrote them)."""
        return self._encode(rendered)[0]

    def encode(self, messages: Messages, trained_turns: Sequence[int], tools: Optional[Tools] = None) -> Encoded:
        """Render ``messages`` once (with the tool schemas ``tools``); ``loss_mask`` is 1 exactly on the tokens of
        the assistant turns whose message indices are ``trained_turns`` (their end-of-turn tokens included; a turn
        that only calls tools: its rendered calls). Every prefix that locates a turn is rendered with the same
        ``tools``, so the tools' header is never part of a turn."""
        full = self.render(messages, tools=tools)
        spans = [self._turn_span(messages, i, full, tools) for i in trained_turns]
        ids, offsets = self._encode(full)
        mask = [int(any(start < end_tok and begin_tok < end for start, end in spans)) for begin_tok, end_tok in offsets]
        return Encoded(tuple(ids), tuple(mask))

    def _turn_span(self, messages: Messages, i: int, full: str, tools: Optional[Tools]) -> Tuple[int, int]:
        """Character span of assistant turn ``i`` in ``full`` (the rendering of every message with ``tools``)."""
        if messages[i].get("role") != "assistant":
            raise ValueError(f"message {i} is a {messages[i].get('role')!r} message; only assistant turns are trained")
        before = self.render(messages[:i], generation_prompt=True, tools=tools) if i else ""
        through = self.render(messages[: i + 1], tools=tools)
        if not (full.startswith(before) and full.startswith(through)) or len(through) < len(before):
            raise ValueError(
                f"the chat template renders earlier turns differently once later turns follow, so "
                f"assistant turn {i} cannot be located in the rendered conversation; train on the last "
                f"turn only (data.assistant_turns=last) or use a prefix-stable template "
                f"(data.chat_template)"
            )
        end = len(through.rstrip())
        if end <= len(before):
            raise ValueError(
                f"assistant turn {i} renders to no text at all (empty content and no end-of-turn "
                f"marker in the template): it has no token to train on"
            )
        return len(before), end

    def _encode(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        # The template writes any BOS itself; the tokenizer must not add a second one.
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def end_of_turn_ids(self) -> Tuple[int, ...]:
        """Token ids the template writes right after an assistant's text (``<|im_end|>``, ``<|eot_id|>``...), when
        they are special tokens: generation must stop on them as it does on EOS."""
        probe = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        try:
            before = self.render(probe[:1], generation_prompt=True)
            through = self.render(probe)
        except ValueError:
            return ()
        if not through.startswith(before + "2"):
            return ()
        ids, offsets = self._encode(through)
        after = len(before) + 1
        special = set(self.tokenizer.all_special_ids) | set(getattr(self.tokenizer, "added_tokens_decoder", {}))
        for token, (begin, _end) in zip(ids, offsets):
            if begin >= after:
                return (token,) if token in special else ()
        return ()


def sft_turns(messages: Messages, which: str) -> List[int]:
    """Indices of the assistant messages an SFT row trains on: ``all`` of them or the ``last``."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise ValueError("the conversation has no assistant message to train on")
    return turns if which == "all" else turns[-1:]
