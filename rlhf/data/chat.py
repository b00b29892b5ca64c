"""Conversational rows: recognising them, rendering them with a chat template, and masking the loss exactly.

A conversational field is a list of ``{"role", "content"}`` messages (TRL's conversational format):

* SFT: ``{"messages": [system?, user, assistant, user, assistant, ...]}``, or ``{"prompt": [messages],
  "response": [assistant messages]}``;
* preference: ``{"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant messages]}``, or
  ``{"chosen": [whole conversation], "rejected": [whole conversation]}`` whose shared leading messages are the
  prompt (the "implicit prompt" form);
* RL prompts: ``{"prompt": [messages]}``, rendered with the generation prompt the model answers after.

(Every layout a trainer reads, text ones and those mixing a text prompt with conversations: :mod:`rlhf.data.layouts`.)

Each sequence is rendered once with the template and tokenized once, with character offsets. The loss mask comes
from those offsets: an assistant turn's characters run from the end of the conversation rendered up to that turn
with the generation prompt, to the end of the conversation rendered through that turn (its end-of-turn token
included, trailing whitespace not). No substring is re-tokenized, so the ids trained on are exactly the ids of
the rendered conversation, and the prompt ids are exactly what the model is given at generation time. A template
that rewrites earlier turns when later ones follow (it is not prefix-stable) cannot be masked this way; such a
row is refused with a message that says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from rlhf.config.schema import ConfigError

ROLES = ("system", "user", "assistant", "tool")
Messages = List[dict]


class ChatTemplateError(ConfigError):
    """Conversational rows with no usable chat template (the message names ``data.chat_template``)."""


def check_messages(value: Any, field: str, *, assistant_only: bool = False) -> Messages:
    """Validate a conversational field and return it; ``ValueError`` names the field and the message index."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"field {field!r} must be a non-empty list of messages, got {_kind(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"field {field!r}: message {i} must be an object with role and content, got {_kind(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"field {field!r}: message {i} has role {role!r}; valid roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"field {field!r}: message {i} ({role}) needs a text 'content', got {_kind(content)}")
        if role == "assistant" and not content.strip():  # else it trains on the end-of-turn token alone
            raise ValueError(f"field {field!r}: message {i} (assistant) is empty: there is no answer to train on")
        if assistant_only and role != "assistant":
            raise ValueError(f"field {field!r}: message {i} has role {role!r}; completions hold assistant messages")
    return value


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
    def render(self, messages: Messages, generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # noqa: BLE001 - a Jinja error (e.g. "roles must alternate") is a data problem
            raise ValueError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") from None

    def prompt_ids(self, messages: Messages) -> List[int]:
        """Token ids of ``messages`` followed by the generation prompt: what the model answers after."""
        return self.tokenize(self.render(messages, generation_prompt=True))

    def tokenize(self, rendered: str) -> List[int]:
        """Token ids of text this template rendered (no special tokens added: the template wrote them)."""
        return self._encode(rendered)[0]

    def encode(self, messages: Messages, trained_turns: Sequence[int]) -> Encoded:
        """Render ``messages`` once; ``loss_mask`` is 1 exactly on the tokens of the assistant turns whose message
        indices are ``trained_turns`` (their end-of-turn tokens included)."""
        full = self.render(messages)
        spans = [self._turn_span(messages, i, full) for i in trained_turns]
        ids, offsets = self._encode(full)
        mask = [int(any(start < end_tok and begin_tok < end for start, end in spans)) for begin_tok, end_tok in offsets]
        return Encoded(tuple(ids), tuple(mask))

    def _turn_span(self, messages: Messages, i: int, full: str) -> Tuple[int, int]:
        """Character span of assistant turn ``i`` in ``full`` (the rendering of every message)."""
        if messages[i].get("role") != "assistant":
            raise ValueError(f"message {i} is a {messages[i].get('role')!r} message; only assistant turns are trained")
        before = self.render(messages[:i], generation_prompt=True) if i else ""
        through = self.render(messages[: i + 1])
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
