"""Tokenizing rows into examples and collating examples into :class:`rlhf.batch.Batch`.

Prompt and completion are tokenized separately (the prompt with the tokenizer's own special tokens, e.g. a BOS,
the completion without, plus EOS) so the boundary between them is exact: ``loss_mask`` is 1 on completion tokens
only. A completion that does not fit ``max_length`` is truncated (and then has no EOS); a row whose prompt alone
leaves no room for one completion token is skipped and counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from rlhf.batch import Batch, pad_sequences


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
    return tokenizer(list(texts), add_special_tokens=special)["input_ids"]


def _completions(tokenizer, texts: Sequence[str], add_eos: bool) -> List[List[int]]:
    ids = _encode(tokenizer, texts, special=False)
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("data.add_eos=true but the tokenizer has no eos_token")
        ids = [seq + [tokenizer.eos_token_id] for seq in ids]
    return ids


def tokenize_sft(rows: Sequence[dict], tokenizer, *, max_length: int, prompt_key: str, response_key: str,
                 add_eos: bool = True) -> Tokenized:
    prompts = _encode(tokenizer, [r[prompt_key] for r in rows], special=True)
    responses = _completions(tokenizer, [r[response_key] for r in rows], add_eos)
    examples, skipped = [], []
    for i, (p, c) in enumerate(zip(prompts, responses)):
        ex = _join(p, c, max_length)
        if ex is None:
            skipped.append(i)
        else:
            examples.append(ex)
    return Tokenized(examples, skipped)


def tokenize_pairs(rows: Sequence[dict], tokenizer, *, max_length: int, prompt_key: str, chosen_key: str,
                   rejected_key: str, margin_key: Optional[str] = None, add_eos: bool = True) -> Tokenized:
    prompts = _encode(tokenizer, [r[prompt_key] for r in rows], special=True)
    chosen = _completions(tokenizer, [r[chosen_key] for r in rows], add_eos)
    rejected = _completions(tokenizer, [r[rejected_key] for r in rows], add_eos)
    examples, skipped = [], []
    for i, (p, c, r) in enumerate(zip(prompts, chosen, rejected)):
        ec, er = _join(p, c, max_length), _join(p, r, max_length)
        if ec is None or er is None:
            skipped.append(i)
            continue
        margin = rows[i].get(margin_key) if margin_key else None
        examples.append(PairExample(ec, er, None if margin is None else float(margin)))
    return Tokenized(examples, skipped)


def collate_sft(examples: Sequence[Example], pad_id: int, indices: Optional[Sequence[int]] = None) -> Batch:
    """Right-pad to the longest example of this batch -> ``(B, T)`` fields."""
    ids = pad_sequences([e.input_ids for e in examples], pad_id)
    return Batch(
        input_ids=ids,
        attention_mask=pad_sequences([[1] * len(e.input_ids) for e in examples], 0, ids.shape[1]),
        loss_mask=pad_sequences([e.loss_mask for e in examples], 0, ids.shape[1]),
        sample_index=None if indices is None else torch.tensor(list(indices), dtype=torch.long),
    )


def collate_pairs(examples: Sequence[PairExample], pad_id: int, indices: Optional[Sequence[int]] = None,
                  ref_logps: Optional[torch.Tensor] = None) -> Batch:
    """Pairs -> ``(B, 2, T)`` fields (chosen at index 0), padded to the longest completion of the batch."""
    flat = [seq for pair in examples for seq in (pair.chosen, pair.rejected)]
    inner = collate_sft(flat, pad_id)
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
