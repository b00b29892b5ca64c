"""The row formats each trainer reads, plain or conversational, checked row by row as they are read.

Each ``*_fields`` function returns the :func:`rlhf.data.io.read_rows` arguments for one trainer: the fields to keep,
their allowed types and a per-row ``check`` that tells a plain row from a conversational one and refuses a row that
mixes them, so a bad row is reported with its file and line. :func:`chat_formatter` then builds the chat template
renderer when (and only when) the rows read are conversational.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from rlhf.data.chat import ChatFormatter, check_messages, is_conversation, load_template

_TEXT_OR_MESSAGES = (str, list)


def _fields(keys: Sequence[str], check: Callable[[dict], None], extra_types: Optional[dict] = None) -> Dict[str, Any]:
    types = {k: _TEXT_OR_MESSAGES for k in keys}
    types.update(extra_types or {})
    return dict(required=(), optional=tuple(keys), types=types, check=check)


def _need(row: dict, keys: Sequence[str], form: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        has = ", ".join(sorted(row)) or "none of them"
        raise ValueError(f"missing field {missing[0]!r} for {form} (fields found: {has})")


def sft_fields(prompt_key: str, response_key: str, messages_key: str) -> Dict[str, Any]:
    """SFT: ``{messages_key: [...]}``, or ``prompt_key`` + ``response_key`` both text or both messages."""
    def check(row: dict) -> None:
        if messages_key in row:
            check_messages(row[messages_key], messages_key)
            return
        if prompt_key not in row and response_key not in row:
            raise ValueError(f"expected {messages_key!r} (a conversation) or {prompt_key!r} and {response_key!r}; "
                             f"the row has none of them")
        _need(row, (prompt_key, response_key), f"a {prompt_key!r}/{response_key!r} row")
        _same_form(row, prompt_key, (response_key,))
        if not isinstance(row[response_key], str):
            check_messages(row[response_key], response_key, assistant_only=True)
    return _fields((messages_key, prompt_key, response_key), check)


def pair_fields(prompt_key: str, chosen_key: str, rejected_key: str, margin_key: str = "",
                margin_required: bool = False) -> Dict[str, Any]:
    """Preference pairs: text ``prompt``/``chosen``/``rejected``, or messages (``prompt`` optional: whole
    conversations that share their first turns)."""
    def check(row: dict) -> None:
        _need(row, (chosen_key, rejected_key), "a preference pair")
        if margin_required:
            _need(row, (margin_key,), "a pair with a margin (rm.use_margin=true)")
        if isinstance(row[chosen_key], str):
            _need(row, (prompt_key,), "a text pair")
        keys = (chosen_key, rejected_key) + ((prompt_key,) if prompt_key in row else ())
        _same_form(row, keys[0], keys[1:])
        if prompt_key in row and is_conversation(row[chosen_key]):
            check_messages(row[chosen_key], chosen_key, assistant_only=True)
            check_messages(row[rejected_key], rejected_key, assistant_only=True)
    keys = (prompt_key, chosen_key, rejected_key) + ((margin_key,) if margin_key else ())
    return _fields(keys, check, {margin_key: (int, float)} if margin_key else None)


def prompt_fields(prompt_key: str, columns: Sequence[str] = ()) -> Dict[str, Any]:
    """RL prompts: ``prompt_key`` as text or messages, plus reward-function columns when present."""
    def check(row: dict) -> None:
        _need(row, (prompt_key,), "a prompt row")
        if not isinstance(row[prompt_key], str):
            check_messages(row[prompt_key], prompt_key)
    fields = _fields((prompt_key,), check)
    fields["optional"] = (prompt_key,) + tuple(c for c in columns if c != prompt_key)
    return fields


def _same_form(row: dict, first: str, others: Sequence[str]) -> None:
    """Every named field is text, or every one is a list of messages."""
    text = isinstance(row[first], str)
    for key in others:
        if isinstance(row[key], str) != text:
            kind = lambda k: "text" if isinstance(row[k], str) else "messages"  # noqa: E731
            raise ValueError(f"field {first!r} is {kind(first)} but {key!r} is {kind(key)}: a row is either plain "
                             f"text or conversational throughout")
        if not text:
            check_messages(row[key], key)
    if not text:
        check_messages(row[first], first)


def is_conversational(rows: Sequence[dict], keys: Sequence[str]) -> bool:
    """Whether any row holds messages in one of ``keys``."""
    return any(isinstance(row.get(k), list) for row in rows for k in keys)


def chat_formatter(tokenizer, setting: str, *row_sets: Sequence[dict], keys: Sequence[str]) -> Optional[ChatFormatter]:
    """The renderer for conversational rows (``data.chat_template`` = ``setting``), or None when every row is plain
    text. Raises :class:`~rlhf.data.chat.ChatTemplateError` (naming the key) when rows need a template there is not."""
    if not any(is_conversational(rows, keys) for rows in row_sets):
        return None
    return ChatFormatter(tokenizer, load_template(setting), setting)
