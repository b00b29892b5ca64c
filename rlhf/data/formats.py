"""The row formats each trainer reads, plain or conversational, checked row by row as they are read.

Each ``*_fields`` function returns the :func:`rlhf.data.io.read_rows` arguments for one trainer: the fields to keep,
their allowed types and a per-row ``check`` that recognises the row's layout (:mod:`rlhf.data.layouts`) and refuses a
row in none, so a bad row is reported with its file and line, every field it has and the key to set.
:func:`chat_formatter` then builds the chat template renderer when (and only when) the rows read are
conversational; :func:`read_formatted` does both.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from rlhf.data.chat import ChatFormatter, ChatTemplateError, check_messages, load_template, row_tools
from rlhf.data.io import DataError, FieldsError, read_rows
from rlhf.data.layouts import COMPLETION, pair_parts, sft_parts, unpaired_parts
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


def sft_fields(
    prompt_key: str, response_key: str, messages_key: str, text_key: str = "text", tools_key: str = "tools"
) -> Dict[str, Any]:
    """SFT: ``{messages_key: [...]}``; ``prompt_key`` + ``response_key`` (or ``completion``) both text or both
    messages; or ``{text_key: "..."}`` (:func:`rlhf.data.layouts.sft_parts`). ``tools_key``: the row's tool schemas,
    when it has them (:func:`rlhf.data.chat.parse_tools`)."""

    def check(row: dict) -> None:
        sft_parts(row, prompt_key, response_key, messages_key, text_key)
        row_tools(row, tools_key)

    keys = (messages_key, prompt_key, response_key) + ((COMPLETION,) if COMPLETION != response_key else ())
    return _fields(keys + tuple(k for k in (text_key, tools_key) if k), check)


def pair_fields(
    prompt_key: str,
    chosen_key: str,
    rejected_key: str,
    margin_key: str = "",
    margin_required: bool = False,
    tools_key: str = "tools",
) -> Dict[str, Any]:
    """Preference pairs in any layout of :func:`rlhf.data.layouts.pair_parts`: text or messages, the prompt
    explicit, implicit (shared by the answers), or carried by whole conversations. ``tools_key``: the row's tool
    schemas, when it has them (:func:`rlhf.data.chat.parse_tools`), rendered with both sides."""

    def check(row: dict) -> None:
        pair_parts(row, prompt_key, chosen_key, rejected_key)
        row_tools(row, tools_key)
        if margin_required and margin_key not in row:
            raise FieldsError(
                f"missing field {margin_key!r} for a pair with a margin (rm.use_margin=true)",
                missing=margin_key,
                advice="Set data.margin_key to the field that holds the margin, or rm.use_margin=false.",
            )

    keys = tuple(k for k in (prompt_key, chosen_key, rejected_key, tools_key) if k) + (
        (margin_key,) if margin_key else ()
    )
    return _fields(keys, check, {margin_key: (int, float)} if margin_key else None)


def unpaired_fields(prompt_key: str, completion_key: str, label_key: str, tools_key: str = "tools") -> Dict[str, Any]:
    """Unpaired preference rows (KTO) in any layout of :func:`rlhf.data.layouts.unpaired_parts`: a prompt and one
    completion, text or messages, and a boolean label. ``tools_key``: the row's tool schemas, when it has them."""

    def check(row: dict) -> None:
        unpaired_parts(row, prompt_key, completion_key, label_key)
        row_tools(row, tools_key)

    keys = tuple(k for k in (prompt_key, completion_key, tools_key) if k)
    return _fields(keys, check, optional=(label_key,))


def prompt_fields(
    prompt_key: str,
    columns: Sequence[str] = (),
    required_columns: Optional[Mapping[str, Sequence[str]]] = None,
    tools_key: str = "tools",
) -> Dict[str, Any]:
    """RL prompts: ``prompt_key`` as text or messages, plus reward-function columns when present;
    ``required_columns``: ``{config key: the columns a user named there}`` (``reward.columns``, ``env.columns``),
    each of which must be in every row (a typo is refused naming the key, with the row's fields). ``tools_key``: the
    row's tool schemas, when it has them (:func:`rlhf.data.chat.parse_tools`)."""
    required = {key: tuple(named) for key, named in (required_columns or {}).items()}

    def check(row: dict) -> None:
        if prompt_key not in row:
            raise FieldsError(
                f"missing field {prompt_key!r} for a prompt row",
                missing=prompt_key,
                advice="Set data.prompt_key to the field that holds the prompt.",
            )
        if not isinstance(row[prompt_key], str):
            check_messages(row[prompt_key], prompt_key)
        row_tools(row, tools_key)
        for key, named in required.items():
            for column in named:
                if column not in row:
                    raise FieldsError(
                        f"{key} names {column!r} but the row has no such field",
                        missing=column,
                        advice=f"Set {key} to fields the prompt rows have.",
                    )

    named_columns = tuple(c for named in required.values() for c in named)
    keys = (prompt_key,) + ((tools_key,) if tools_key and tools_key != prompt_key else ())
    optional = tuple(dict.fromkeys(c for c in tuple(columns) + named_columns if c not in keys))
    return _fields(keys, check, optional=optional)


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
    data,
    path: str,
    split: str,
    tokenizer,
    fields: Dict[str, Any],
    chat_keys: Sequence[str],
    user_turn_key: str = "",
) -> Tuple[list, Optional[ChatFormatter]]:
    """A trainer's rows of ``path`` (``split``, ``data.config_name``), checked with ``fields`` (a ``*_fields``
    result), and the chat renderer they need (``data.chat_template``), None for plain text. ``user_turn_key``: a
    field whose text is read as one user message (:func:`as_user_turn`)."""
    rows = read_rows(path, split=split, config_name=data.config_name, **fields)
    if not user_turn_key:
        return rows, chat_formatter(tokenizer, data.chat_template, rows, keys=chat_keys)
    rows = [as_user_turn(row, user_turn_key) for row in rows]  # rendered with the template like any conversation
    try:
        return rows, chat_formatter(tokenizer, data.chat_template, rows, keys=chat_keys)
    except ChatTemplateError as e:
        raise ChatTemplateError(
            f"{e} (data.template_text_prompts=true makes every text prompt a conversation)"
        ) from None


def text_prompts_note(rows: Sequence[dict], key: str, tokenizer) -> str:
    """A line for RL text prompts given as written to a model whose tokenizer has a chat template (an Instruct
    model then sees text without its turns), naming ``data.template_text_prompts``; "" otherwise."""
    text = sum(isinstance(row.get(key), str) for row in rows)
    if not text or not getattr(tokenizer, "chat_template", None):
        return ""
    return (
        f"{text} text prompts (data.prompt_key={key}) are given to the model as written, without the tokenizer's "
        f"chat template; data.template_text_prompts=true renders each as one user turn"
    )


def as_user_turn(row: dict, key: str) -> dict:
    """``row`` with the text of ``key`` as one user message (``data.template_text_prompts``); messages as they are."""
    text = row[key]
    return {**row, key: [{"role": "user", "content": text}]} if isinstance(text, str) else row


@contextlib.contextmanager
def located(key: str, path: str):
    """A row the chat template cannot render (:class:`~rlhf.data.tokenize.RowError`) becomes a
    :class:`~rlhf.data.io.DataError` naming the config key and its source."""
    try:
        yield
    except RowError as e:
        raise DataError(f"{key}={path}: {e}") from None
