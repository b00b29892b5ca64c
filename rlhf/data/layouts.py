"""The row layouts the trainers read, recognised row by row: which fields hold the prompt and the answers.

Pure functions of one row (no tokenizer): the row checks of :mod:`rlhf.data.formats` call them to refuse a row with
its file and line, and :mod:`rlhf.data.tokenize` calls them again to take the row apart the same way.

Preference pairs (:func:`pair_parts`, TRL's layouts plus two that people download):

* explicit prompt: ``prompt`` + ``chosen`` / ``rejected``, all text or all messages (answers: assistant messages);
* implicit prompt, conversational: ``chosen`` / ``rejected`` whole conversations whose shared leading messages are
  the prompt;
* UltraFeedback-binarized: a ``prompt`` string beside whole conversations (the user turn included): the
  conversations carry the prompt, the string is not used;
* a ``prompt`` string beside answers that are assistant messages only: the string is one user turn;
* implicit prompt, text: ``chosen`` / ``rejected`` strings sharing a prefix. Anthropic HH-RLHF's
  ``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` strings: the prompt runs through the last ``"\\n\\nAssistant:"`` of the
  shared prefix; other text: the prompt is the shared prefix cut before its last whitespace, the answers start with
  that whitespace (TRL's ``extract_prompt`` cuts the same way).

Unpaired preference rows (:func:`unpaired_parts`, TRL's unpaired layout, for KTO): ``prompt`` + ``completion`` +
``label`` (true: a desirable answer), prompt and completion both text or both messages (the completion: assistant
messages), or a ``prompt`` string before assistant messages (the string is one user turn).

SFT rows (:func:`sft_parts`): ``messages``; ``prompt`` + ``response`` (or TRL's ``completion`` when the row has no
``response`` field), both text or both messages; a plain ``text`` column trained on whole.
"""

from __future__ import annotations

from typing import Any, Tuple

from rlhf.data.chat import check_messages, split_implicit_prompt
from rlhf.data.io import FieldsError

HH_ASSISTANT = "\n\nAssistant:"  # Anthropic HH-RLHF's turn marker: the answer follows the last one
COMPLETION = "completion"  # TRL's name for the SFT answer, read when the row has no data.response_key field


def _kind(value: Any) -> str:
    return "text" if isinstance(value, str) else "messages"


def _mixed(row: dict, first: str, second: str) -> ValueError:
    return ValueError(
        f"field {first!r} is {_kind(row[first])} but {second!r} is {_kind(row[second])}: a row is either plain "
        f"text or conversational throughout"
    )


def split_text_prompt(chosen: str, rejected: str) -> Tuple[str, str, str]:
    """``(prompt, chosen completion, rejected completion)`` of two texts that start with the same prompt.

    HH-RLHF text (the shared prefix holds ``"\\n\\nAssistant:"``): the prompt ends with its last occurrence there.
    Other text: the prompt is the shared prefix up to its last whitespace, which starts both completions.

    Raises:
        FieldsError: When the texts share no prompt (the message names ``data.prompt_key``).
    """
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    shared = chosen[:n]
    marker = shared.rfind(HH_ASSISTANT)
    if marker >= 0:
        end = marker + len(HH_ASSISTANT)
    else:
        end = max((i for i, c in enumerate(shared) if c.isspace()), default=0)
        end = len(shared[:end].rstrip())  # a run of whitespace goes to the completions whole
    if end == 0:
        raise FieldsError(
            "text fields 'chosen' and 'rejected' share no prompt (no common leading words, no "
            f"{HH_ASSISTANT.strip()!r} turn) and the row has no prompt field",
            missing="prompt",
            advice="Set data.prompt_key to the field that holds the prompt.",
        )
    return chosen[:end], chosen[end:], rejected[end:]


def pair_parts(row: dict, prompt_key: str, chosen_key: str, rejected_key: str) -> Tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of a preference row in any layout of the module docstring: three texts, or
    three lists of messages (the answers: assistant messages only).

    Raises:
        FieldsError: A field is missing or the prompt cannot be found (the message names the key to set).
        ValueError: The fields mix text and messages in a way no layout does, or a message is malformed.
    """
    for key, name, what in ((chosen_key, "chosen", "preferred"), (rejected_key, "rejected", "dispreferred")):
        _require(row, key, "a preference pair", f"Set data.{name}_key to the field that holds the {what} answer.")
    chosen, rejected = row[chosen_key], row[rejected_key]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise _mixed(row, chosen_key, rejected_key)
    prompt = row.get(prompt_key) if prompt_key else None
    if isinstance(chosen, str):
        if prompt is None:
            return split_text_prompt(chosen, rejected)
        if not isinstance(prompt, str):
            raise _mixed(row, chosen_key, prompt_key)
        return prompt, chosen, rejected
    if isinstance(prompt, list):  # explicit conversational prompt: the answers follow it
        check_messages(prompt, prompt_key)
        check_messages(chosen, chosen_key, assistant_only=True)
        return prompt, chosen, check_messages(rejected, rejected_key, assistant_only=True)
    check_messages(chosen, chosen_key)
    check_messages(rejected, rejected_key)
    whole = any(m["role"] != "assistant" for m in chosen + rejected)
    if prompt is None or whole:  # implicit prompt; UltraFeedback: the conversations carry the prompt string's turn
        return split_implicit_prompt(chosen, rejected)
    return [{"role": "user", "content": prompt}], chosen, rejected


def _require(row: dict, key: str, what: str, advice: str) -> None:
    """Refuse a row without ``key``: the error names the key and, through ``advice``, the setting to change."""
    if key not in row:
        raise FieldsError(f"missing field {key!r} for {what}", missing=key, advice=advice)


def sft_parts(row: dict, prompt_key: str, response_key: str, messages_key: str, text_key: str) -> Tuple[Any, ...]:
    """The layout of an SFT row and its parts: ``("messages", messages)``, ``("pair", prompt, completion)`` (two
    texts or two lists of messages) or ``("text", text)``.

    Raises:
        FieldsError: The row has none of the layouts' fields, or half of a pair (the message names the key to set).
        ValueError: A pair mixes text and messages, or a message is malformed.
    """
    if messages_key in row:
        return ("messages", check_messages(row[messages_key], messages_key))
    answer = response_key if response_key in row or COMPLETION not in row else COMPLETION
    if prompt_key in row or answer in row:
        for key, name in ((prompt_key, "prompt"), (answer, "response")):
            _require(
                row, key, f"a {prompt_key!r}/{answer!r} row", f"Set data.{name}_key to the field that holds the {name}."
            )
        prompt, completion = row[prompt_key], row[answer]
        if isinstance(prompt, str) != isinstance(completion, str):
            raise _mixed(row, prompt_key, answer)
        if not isinstance(prompt, str):
            check_messages(prompt, prompt_key)
            check_messages(completion, answer, assistant_only=True)
        return ("pair", prompt, completion)
    if text_key and text_key in row:
        if not isinstance(row[text_key], str):
            raise ValueError(
                f"field {text_key!r} must be text, got messages (a conversation goes in data.messages_key)"
            )
        return ("text", row[text_key])
    text = f", or {text_key!r} (text trained on whole)" if text_key else ""
    raise FieldsError(
        f"expected {messages_key!r} (a conversation), {prompt_key!r} with {response_key!r} or {COMPLETION!r}{text}; "
        f"the row has none of them",
        missing=(messages_key, prompt_key, response_key, text_key),
        advice="Set data.messages_key, data.prompt_key and data.response_key, or data.text_key to the row's fields.",
    )


def unpaired_parts(row: dict, prompt_key: str, completion_key: str, label_key: str) -> Tuple[Any, Any, bool]:
    """``(prompt, completion, desirable)`` of an unpaired preference row (module docstring): two texts or two lists
    of messages, and the label.

    Raises:
        FieldsError: A field is missing (the message names the key to set).
        ValueError: The label is not a boolean (or 0 / 1), the fields mix text and messages, or a message is
            malformed.
    """
    for key, name, what in (
        (prompt_key, "prompt", "prompt"),
        (completion_key, "completion", "answer"),
        (label_key, "label", "label (true: desirable answer)"),
    ):
        _require(row, key, "an unpaired preference row", f"Set data.{name}_key to the field that holds the {what}.")
    label = row[label_key]
    if not isinstance(label, (bool, int)) or label not in (0, 1):  # 0 / 1 read as false / true
        raise ValueError(f"field {label_key!r} must be true or false (desirable or not), got {label!r}")
    prompt, completion = row[prompt_key], row[completion_key]
    if isinstance(completion, str):
        if not isinstance(prompt, str):
            raise _mixed(row, prompt_key, completion_key)
        return prompt, completion, bool(label)
    check_messages(completion, completion_key, assistant_only=True)
    if isinstance(prompt, str):  # a prompt string before assistant messages: one user turn
        return [{"role": "user", "content": prompt}], completion, bool(label)
    return check_messages(prompt, prompt_key), completion, bool(label)
