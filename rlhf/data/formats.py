"""The row formats each trainer reads, plain or conversational, checked row by row as they are read.

Each ``*_fields`` function returns the :func:`rlhf.data.io.read_rows` arguments for one trainer: the fields to keep,
their allowed types and a per-row ``check`` that tells a plain row from a conversational one and refuses a row that
mixes them, so a bad row is reported with its file and line. :func:`chat_formatter` then builds the chat template
renderer when (and only when) the rows read are conversational; :func:`read_formatted` does both.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from rlhf.data.chat import ChatFormatter, check_messages, load_template
from rlhf.data.io import DataError, read_rows
from rlhf.data.tokenize import RowError

_TEXT_OR_MESSAGES = (str, list)


def _fields(
    keys: Sequence[str], check: Callable[[dict], None], extra_types: Optional[dict] = None, optional: Sequence[str] = ()
) -> Dict[str, Any]:
    """``read_rows`` arguments: ``keys`` kept and typed text-or-messages (``extra_types`` overrides), ``optional``
    kept untyped, every row through ``check``."""
    types = {k: _TEXT_OR_MESSAGES for k in keys}
    types.update(extra_types or {})
    return dict(required=(), optional=tuple(keys) + tuple(optional), types=types, check=check)


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
            raise ValueError(
                f"expected {messages_key!r} (a conversation) or {prompt_key!r} and {response_key!r}; "
                f"the row has none of them"
            )
        _need(row, (prompt_key, response_key), f"a {prompt_key!r}/{response_key!r} row")
        if not _same_form(row, (prompt_key, response_key)):
            check_messages(row[prompt_key], prompt_key)
            check_messages(row[response_key], response_key, assistant_only=True)

    return _fields((messages_key, prompt_key, response_key), check)


def pair_fields(
    prompt_key: str, chosen_key: str, rejected_key: str, margin_key: str = "", margin_required: bool = False
) -> Dict[str, Any]:
    """Preference pairs: text ``prompt``/``chosen``/``rejected``, or messages (``prompt`` optional: whole
    conversations that share their first turns)."""

    def check(row: dict) -> None:
        _need(row, (chosen_key, rejected_key), "a preference pair")
        if margin_required:
            _need(row, (margin_key,), "a pair with a margin (rm.use_margin=true)")
        if isinstance(row[chosen_key], str):
            _need(row, (prompt_key,), "a text pair")
        explicit = prompt_key in row
        if _same_form(row, (chosen_key, rejected_key) + ((prompt_key,) if explicit else ())):
            return
        if explicit:
            check_messages(row[prompt_key], prompt_key)
        for key in (chosen_key, rejected_key):  # after an explicit prompt: the answers; else whole conversations
            check_messages(row[key], key, assistant_only=explicit)

    keys = (prompt_key, chosen_key, rejected_key) + ((margin_key,) if margin_key else ())
    return _fields(keys, check, {margin_key: (int, float)} if margin_key else None)


def prompt_fields(prompt_key: str, columns: Sequence[str] = ()) -> Dict[str, Any]:
    """RL prompts: ``prompt_key`` as text or messages, plus reward-function columns when present."""

    def check(row: dict) -> None:
        _need(row, (prompt_key,), "a prompt row")
        if not isinstance(row[prompt_key], str):
            check_messages(row[prompt_key], prompt_key)

    return _fields((prompt_key,), check, optional=tuple(c for c in columns if c != prompt_key))


def _same_form(row: dict, keys: Sequence[str]) -> bool:
    """Whether the named fields are all text (True) or all lists of messages (False); a mix is refused."""
    text = isinstance(row[keys[0]], str)
    for key in keys[1:]:
        if isinstance(row[key], str) != text:
            kind = lambda k: "text" if isinstance(row[k], str) else "messages"  # noqa: E731
            raise ValueError(
                f"field {keys[0]!r} is {kind(keys[0])} but {key!r} is {kind(key)}: a row is either "
                f"plain text or conversational throughout"
            )
    return text


def is_conversational(rows: Sequence[dict], keys: Sequence[str]) -> bool:
    """Whether any row holds messages in one of ``keys``."""
    return any(isinstance(row.get(k), list) for row in rows for k in keys)


def chat_formatter(tokenizer, setting: str, rows: Sequence[dict], keys: Sequence[str]) -> Optional[ChatFormatter]:
    """The renderer for conversational rows (``data.chat_template`` = ``setting``), or None when every row is plain
    text. Raises :class:`~rlhf.data.chat.ChatTemplateError` (naming the key) when rows need a template there is not."""
    if not is_conversational(rows, keys):
        return None
    return ChatFormatter(tokenizer, load_template(setting), setting)


def read_formatted(
    data, path: str, split: str, tokenizer, fields: Dict[str, Any], chat_keys: Sequence[str]
) -> Tuple[list, Optional[ChatFormatter]]:
    """A trainer's rows of ``path`` (``split``, ``data.config_name``), checked with ``fields`` (a ``*_fields``
    result), and the chat renderer they need (``data.chat_template``), None for plain text."""
    rows = read_rows(path, split=split, config_name=data.config_name, **fields)
    return rows, chat_formatter(tokenizer, data.chat_template, rows, keys=chat_keys)


@contextlib.contextmanager
def located(key: str, path: str):
    """A row the chat template cannot render (:class:`~rlhf.data.tokenize.RowError`) becomes a
    :class:`~rlhf.data.io.DataError` naming the config key and its source."""
    try:
        yield
    except RowError as e:
        raise DataError(f"{key}={path}: {e}") from None
