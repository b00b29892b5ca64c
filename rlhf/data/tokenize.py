"""Tokenizing rows into examples and collating examples into :class:`rlhf.batch.Batch`.

Plain rows: prompt and completion are tokenized separately (the prompt with the tokenizer's own special tokens,
e.g. a BOS, the completion without, plus EOS) so the boundary between them is exact: ``loss_mask`` is 1 on
completion tokens only. A completion that does not fit ``max_length`` is truncated (and then has no EOS); a row
whose prompt alone leaves no room for one completion token is skipped and counted. A plain ``text`` SFT row is
one completion with an empty prompt: tokenized with the tokenizer's special tokens (a BOS, when it adds one), plus
EOS under ``data.add_eos`` (so the model learns where a document ends), and trained on every token but the first,
which nothing predicts; cut at ``max_length`` (then without EOS).

Conversational rows are rendered with a chat template and tokenized once; their masks come from token offsets
(:mod:`rlhf.data.chat`). They are cut at ``max_length`` tokens, and skipped when no trained token is left.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, cast

import torch

from rlhf.batch import Batch, pad_sequences
from rlhf.data.chat import row_tools, sft_turns
from rlhf.data.layouts import pair_parts, sft_parts, unpaired_parts


@dataclass(frozen=True)
class Example:
    """One tokenized sequence. ``loss_mask[t] == 1`` on completion tokens (never at t=0)."""

    input_ids: Tuple[int, ...]
    loss_mask: Tuple[int, ...]

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask[1:])


@dataclass(frozen=True)
class PairExample:
    chosen: Example
    rejected: Example
    margin: Optional[float] = None


@dataclass(frozen=True)
class UnpairedExample:
    """An unpaired preference row (KTO): its completion, the mismatched sequence of its prompt with another row's
    completion (for the KL reference point), and its label."""

    completion: Example
    mismatched: Example
    desirable: bool


def example_lengths(example) -> Tuple[int, ...]:
    """The token lengths of an example's sequences: ``(L,)``, or two lengths for a pair or an unpaired row (its
    completion and its mismatched sequence)."""
    if isinstance(example, PairExample):
        return (len(example.chosen.input_ids), len(example.rejected.input_ids))
    if isinstance(example, UnpairedExample):
        return (len(example.completion.input_ids), len(example.mismatched.input_ids))
    return (len(example.input_ids),)


@dataclass(frozen=True)
class Tokenized:
    """Examples plus the rows dropped because the prompt did not fit ``max_length``."""

    examples: list
    skipped_rows: List[int]


def _join(prompt_ids: Sequence[int], completion_ids: Sequence[int], max_length: int) -> Optional[Example]:
    room = max_length - len(prompt_ids)
    if room < 1 or not completion_ids:
        return None
    completion_ids = list(completion_ids)[:room]
    ids = tuple(prompt_ids) + tuple(completion_ids)
    mask = (0,) * len(prompt_ids) + (1,) * len(completion_ids)
    if not prompt_ids:  # nothing predicts the first token of a completion with an empty prompt
        mask = (0,) + mask[1:]
    return Example(ids, mask)


def _encode(tokenizer, texts: Sequence[str], special: bool) -> List[List[int]]:
    if not texts:  # HF tokenizers fail on an empty batch
        return []
    return tokenizer(list(texts), add_special_tokens=special)["input_ids"]


def _completions(tokenizer, texts: Sequence[str], add_eos: bool) -> List[List[int]]:
    ids = _encode(tokenizer, texts, special=False)
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("data.add_eos=true but the tokenizer has no eos_token")
        ids = [seq + [tokenizer.eos_token_id] for seq in ids]
    return ids


class RowError(ValueError):
    """A row that cannot be tokenized; ``index`` is its 0-based position among the rows read."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"row {index} (0-based): {message}")
        self.index = index


@contextlib.contextmanager
def row_errors(index: int):
    """A ``ValueError`` raised for row ``index`` (e.g. by the chat template) becomes a :class:`RowError`."""
    try:
        yield
    except RowError:
        raise
    except ValueError as e:  # the chat template refused the conversation, or it has no assistant turn
        raise RowError(index, str(e)) from None


def _truncated(encoded, max_length: int) -> Optional[Example]:
    """A rendered conversation cut to ``max_length`` tokens, or None when no target token is left in it."""
    ids, mask = encoded.input_ids[:max_length], (0,) + tuple(encoded.loss_mask[1:max_length])
    return Example(tuple(ids), mask) if any(mask) else None


def _text_example(ids: Sequence[int], max_length: int) -> Optional[Example]:
    """A ``text`` row: every token a target but the first, which nothing predicts; None when under two tokens."""
    ids = tuple(ids)[:max_length]
    return Example(ids, (0,) + (1,) * (len(ids) - 1)) if len(ids) > 1 else None


def tokenize_sft(
    rows: Sequence[dict],
    tokenizer,
    *,
    max_length: int,
    prompt_key: str,
    response_key: str,
    add_eos: bool = True,
    messages_key: str = "messages",
    chat=None,
    assistant_turns: str = "all",
    text_key: str = "text",
    tools_key: str = "tools",
) -> Tokenized:
    """SFT rows in any layout of :func:`rlhf.data.layouts.sft_parts` -> examples; rows left without a target are
    skipped. Plain prompt + response text: the prompt with the tokenizer's special tokens, the response without, plus
    EOS (``add_eos``). A ``text`` row: tokenized whole with the tokenizer's special tokens, plus EOS (``add_eos``),
    every token trained. Conversations: rendered with ``chat`` (a :class:`~rlhf.data.chat.ChatFormatter`), with the
    row's tool schemas (its ``tools_key`` field) when it has them."""
    parts = {}
    for i, row in enumerate(rows):
        with row_errors(i):
            parts[i] = sft_parts(row, prompt_key, response_key, messages_key, text_key)
    plain = [i for i, p in parts.items() if p[0] == "pair" and isinstance(p[1], str)]
    prompts = _encode(tokenizer, [parts[i][1] for i in plain], special=True)
    responses = _completions(tokenizer, [parts[i][2] for i in plain], add_eos)
    by_row = {i: _join(p, c, max_length) for i, p, c in zip(plain, prompts, responses)}
    texts = [i for i, p in parts.items() if p[0] == "text"]
    whole = _encode(tokenizer, [parts[i][1] for i in texts], special=True)
    eos = [tokenizer.eos_token_id] if add_eos and texts else []
    if eos == [None]:
        raise ValueError("data.add_eos=true but the tokenizer has no eos_token")
    by_row.update({i: _text_example(list(ids) + eos, max_length) for i, ids in zip(texts, whole)})
    for i in range(len(rows)):
        if i in by_row:
            continue
        with row_errors(i):
            tools = row_tools(rows[i], tools_key)
            if parts[i][0] == "messages":
                messages = parts[i][1]
                encoded = chat.encode(messages, sft_turns(messages, assistant_turns), tools)
            else:
                prompt, completion = parts[i][1:]
                encoded = chat.encode(prompt + completion, range(len(prompt), len(prompt) + len(completion)), tools)
        by_row[i] = _truncated(encoded, max_length)
    examples = [by_row[i] for i in range(len(rows)) if by_row[i] is not None]
    return Tokenized(examples, [i for i in range(len(rows)) if by_row[i] is None])


def _conversational_pair(prompt: list, chosen: list, rejected: list, chat, tools):
    start = len(prompt)
    return (
        chat.encode(prompt + chosen, range(start, start + len(chosen)), tools),
        chat.encode(prompt + rejected, range(start, start + len(rejected)), tools),
    )


def tokenize_pairs(
    rows: Sequence[dict],
    tokenizer,
    *,
    max_length: int,
    prompt_key: str,
    chosen_key: str,
    rejected_key: str,
    margin_key: Optional[str] = None,
    add_eos: bool = True,
    chat=None,
    tools_key: str = "tools",
) -> Tokenized:
    """Preference rows in any layout of :func:`rlhf.data.layouts.pair_parts` -> :class:`PairExample`: plain pairs
    (prompt, chosen and rejected text, the prompt found in the answers when there is no prompt field) tokenized as
    plain SFT rows, conversational ones rendered with ``chat``, both sides with the row's tool schemas (its
    ``tools_key`` field) when it has them; a pair is skipped when either side is left without a target."""
    parts = {}
    for i, row in enumerate(rows):
        with row_errors(i):
            parts[i] = pair_parts(row, prompt_key, chosen_key, rejected_key)
    plain = [i for i, p in parts.items() if isinstance(p[1], str)]
    prompts = _encode(tokenizer, [parts[i][0] for i in plain], special=True)
    chosen = _completions(tokenizer, [parts[i][1] for i in plain], add_eos)
    rejected = _completions(tokenizer, [parts[i][2] for i in plain], add_eos)
    sides = {
        i: (_join(p, c, max_length), _join(p, r, max_length)) for i, p, c, r in zip(plain, prompts, chosen, rejected)
    }
    for i in range(len(rows)):
        if i not in sides:
            with row_errors(i):
                encoded = _conversational_pair(*parts[i], chat, row_tools(rows[i], tools_key))
            # cast: encoded is _conversational_pair's (chosen, rejected), so the tuple has two items.
            sides[i] = cast(
                Tuple[Optional[Example], Optional[Example]], tuple(_truncated(e, max_length) for e in encoded)
            )
    examples, skipped = [], []
    for i in range(len(rows)):
        ec, er = sides[i]
        if ec is None or er is None:
            skipped.append(i)
            continue
        margin = rows[i].get(margin_key) if margin_key else None
        examples.append(PairExample(ec, er, None if margin is None else float(margin)))
    return Tokenized(examples, skipped)


def tokenize_unpaired(
    rows: Sequence[dict],
    tokenizer,
    *,
    max_length: int,
    prompt_key: str,
    completion_key: str,
    label_key: str,
    add_eos: bool = True,
    chat=None,
    tools_key: str = "tools",
) -> Tokenized:
    """Unpaired preference rows (:func:`rlhf.data.layouts.unpaired_parts`) -> :class:`UnpairedExample`: plain rows
    tokenized as plain SFT rows, conversational ones rendered with ``chat``; a row left without a target is skipped.

    The mismatched sequence of the ``k``-th of ``n`` kept rows of a kind (plain or conversational) is its prompt
    with the completion of the kept row ``(k + n // 2) mod n`` of that kind. TRL shifts completions by one row
    instead, which pairs a prompt with its own other answer in data unpaired from pairs (each pair's two rows side
    by side); half a dataset away, the two rows of a pair are never each other's mismatch. It is cut at
    ``max_length`` like any row (a conversation whose prompt then leaves no target keeps no target: it adds 0 to
    the KL estimate).

    Raises:
        RowError: The one kept row of its kind: a row cannot be mismatched with itself.
    """
    parts = {}
    for i, row in enumerate(rows):
        with row_errors(i):
            parts[i] = unpaired_parts(row, prompt_key, completion_key, label_key)
    plain = [i for i, p in parts.items() if isinstance(p[1], str)]
    prompt_ids = dict(zip(plain, _encode(tokenizer, [parts[i][0] for i in plain], special=True)))
    answer_ids = dict(zip(plain, _completions(tokenizer, [parts[i][1] for i in plain], add_eos)))

    def sequence(i: int, j: int, keep_untrained: bool = False) -> Optional[Example]:
        """The prompt of row ``i`` with the completion of row ``j``; None without a target unless kept."""
        if i in prompt_ids:  # a plain prompt that fits one completion token fits any (completions are non-empty)
            return _join(prompt_ids[i], answer_ids[j], max_length)
        prompt, completion = parts[i][0], parts[j][1]
        with row_errors(i):
            encoded = chat.encode(
                prompt + completion, range(len(prompt), len(prompt) + len(completion)), row_tools(rows[i], tools_key)
            )
        if keep_untrained:
            return _truncated(encoded, max_length) or Example(
                tuple(encoded.input_ids[:max_length]), (0,) * min(len(encoded.input_ids), max_length)
            )
        return _truncated(encoded, max_length)

    own = {i: sequence(i, i) for i in range(len(rows))}
    kept = [i for i in range(len(rows)) if own[i] is not None]
    mismatched: dict = {}
    for group in ([i for i in kept if i in prompt_ids], [i for i in kept if i not in prompt_ids]):
        if len(group) == 1:
            kind = "plain-text" if group[0] in prompt_ids else "conversational"
            raise RowError(
                group[0],
                f"the only {kind} row: KTO's KL estimate pairs each row's prompt with another row's completion of "
                f"the same kind, so it needs at least two",
            )
        for k, i in enumerate(group):
            j = group[(k + len(group) // 2) % len(group)]
            mismatched[i] = sequence(i, j, keep_untrained=True)
    examples = [UnpairedExample(cast(Example, own[i]), mismatched[i], parts[i][2]) for i in kept]
    return Tokenized(examples, [i for i in range(len(rows)) if own[i] is None])


def collate_sft(examples: Sequence[Example], pad_id: int, indices: Optional[Sequence[int]] = None) -> Batch:
    """Right-pad to the longest example of this batch -> ``(B, T)`` fields."""
    ids = pad_sequences([e.input_ids for e in examples], pad_id)
    return Batch(
        input_ids=ids,
        attention_mask=pad_sequences([[1] * len(e.input_ids) for e in examples], 0, ids.shape[1]),
        loss_mask=pad_sequences([e.loss_mask for e in examples], 0, ids.shape[1]),
        sample_index=None if indices is None else torch.tensor(list(indices), dtype=torch.long),
    )


def collate_unpaired(
    examples: Sequence[UnpairedExample],
    pad_id: int,
    indices: Optional[Sequence[int]] = None,
    ref_logps: Optional[torch.Tensor] = None,
) -> Batch:
    """Unpaired rows -> ``(B, 2, T)`` fields in the pair layout (index 0: the row's completion, 1: its mismatched
    sequence) and ``desirable`` ``(B,)``."""
    pairs = [PairExample(e.completion, e.mismatched) for e in examples]
    batch = collate_pairs(pairs, pad_id, indices, ref_logps)
    return batch.replace(desirable=torch.tensor([e.desirable for e in examples], dtype=torch.bool))


def collate_pairs(
    examples: Sequence[PairExample],
    pad_id: int,
    indices: Optional[Sequence[int]] = None,
    ref_logps: Optional[torch.Tensor] = None,
) -> Batch:
    """Pairs -> ``(B, 2, T)`` fields (chosen at index 0), padded to the longest completion of the batch."""
    flat = [seq for pair in examples for seq in (pair.chosen, pair.rejected)]
    inner = collate_sft(flat, pad_id)
    assert inner.loss_mask is not None, "collate_sft always sets loss_mask"
    width = inner.input_ids.shape[1]
    margins = [p.margin for p in examples]
    return Batch(
        input_ids=inner.input_ids.view(len(examples), 2, width),
        attention_mask=inner.attention_mask.view(len(examples), 2, width),
        loss_mask=inner.loss_mask.view(len(examples), 2, width),
        ref_logps=ref_logps,
        margin=None if any(m is None for m in margins) else torch.tensor(margins, dtype=torch.float32),
        sample_index=None if indices is None else torch.tensor(list(indices), dtype=torch.long),
    )
