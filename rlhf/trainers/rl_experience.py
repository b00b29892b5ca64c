"""Turning prompts and generations into the RL train batch (driver side, no actors).

* :func:`prepare_prompts` tokenizes the prompt data once, applying ``rollout.max_prompt_length`` (skip or
  left-truncate, counted).
* :func:`rollout_batch` lays the generations out as one right-padded :class:`Batch`: ``input_ids`` = prompt +
  response, ``loss_mask`` on response tokens, ``rollout_logps`` = the engine's sampling log-probs placed on the
  response columns.
* :func:`advantages_for` computes the advantages of the whole rollout batch at once (group baselines and
  whitening see every sample, never a micro-batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from rlhf.batch import Batch, pad_sequences
from rlhf.data.tokenize import row_errors
from rlhf.ops.advantages import AdvantageInputs, compute_advantages, token_level_rewards, whiten
from rlhf.ops.kl import kl_estimate


@dataclass(frozen=True)
class PromptSet:
    prompt_ids: List[List[int]]
    texts: List[str]  # what reward functions see as the prompt: the text, or the rendered conversation
    columns: Dict[str, List]  # extra fields for reward functions, aligned with prompts
    skipped: int
    truncated: int
    stop_token_ids: Tuple[int, ...] = ()  # generation ends on these: EOS, and the chat template's end of turn


def prepare_prompts(rows: Sequence[dict], tokenizer, *, prompt_key: str, columns: Sequence[str],
                    max_prompt_length: int, overflow: str, chat=None) -> PromptSet:
    """Tokenize every prompt once: text with the tokenizer's special tokens, messages through ``chat`` (a
    :class:`~rlhf.data.chat.ChatFormatter`) with the generation prompt; apply ``max_prompt_length``."""
    plain = [i for i, r in enumerate(rows) if isinstance(r[prompt_key], str)]
    encoded = dict(zip(plain, tokenizer([rows[i][prompt_key] for i in plain], add_special_tokens=True)["input_ids"]
                       if plain else []))
    texts = [r[prompt_key] for r in rows]
    for i, row in enumerate(rows):
        if i not in encoded:  # rendered once: its text is what reward functions see, its ids what the engine gets
            with row_errors(i):
                texts[i] = chat.render(row[prompt_key], generation_prompt=True)
            encoded[i] = chat.tokenize(texts[i])
    keep, ids, skipped, truncated = [], [], 0, 0
    for i in range(len(rows)):
        seq = encoded[i]
        if len(seq) > max_prompt_length:
            if overflow == "skip":
                skipped += 1
                continue
            seq, truncated = seq[-max_prompt_length:], truncated + 1
        keep.append(i)
        ids.append(list(seq))
    present = [c for c in columns if all(c in rows[i] for i in keep)]
    stops = (tokenizer.eos_token_id,) + tuple(t for t in (chat.end_of_turn_ids() if chat else ())
                                              if t != tokenizer.eos_token_id)
    return PromptSet(prompt_ids=ids, texts=[texts[i] for i in keep],
                     columns={c: [rows[i][c] for i in keep] for c in present}, skipped=skipped, truncated=truncated,
                     stop_token_ids=stops)


def rollout_batch(generations: Sequence, pad_id: int) -> Batch:
    """Generations (``rlhf.rollout.vllm_engine.Generation``) -> one ``(B, T)`` batch."""
    seqs = [list(g.prompt_ids) + list(g.response_ids) for g in generations]
    ids = pad_sequences(seqs, pad_id)
    width = ids.shape[1]
    mask = torch.zeros_like(ids)
    rollout = torch.zeros(ids.shape, dtype=torch.float32)
    for row, g in enumerate(generations):
        start, end = len(g.prompt_ids), len(g.prompt_ids) + len(g.response_ids)
        mask[row, start:end] = 1
        rollout[row, start:end] = torch.tensor(g.response_logps, dtype=torch.float32)
    return Batch(input_ids=ids, attention_mask=pad_sequences([[1] * len(s) for s in seqs], 0, width),
                 loss_mask=mask, rollout_logps=rollout, sample_index=torch.arange(len(seqs)))


def advantages_for(batch: Batch, scores: torch.Tensor, group_ids: torch.Tensor, *, estimator: str, gamma: float,
                   lam: float, kl_coef: float, kl_estimator: str, kl_in_reward: bool,
                   whiten_advantages: str = "none") -> Tuple[Batch, dict]:
    """Attach ``advantages`` and ``returns`` to the whole rollout batch; returns it with KL-penalty stats.

    ``whiten_advantages``: ``none``; ``whiten`` (subtract the batch mean, divide by the batch std, over every
    response token of the whole rollout batch); ``scale`` (divide by the std only, keeping each sign).
    """
    # float64 when the policy's log-probs are (strategy.precision=fp64): the advantages are then float64 too
    fp64 = batch.old_logps is not None and batch.old_logps.dtype == torch.float64
    mask = batch.loss_mask.to(torch.float64 if fp64 else torch.float32)
    scores = scores.double() if fp64 else scores
    kl = None
    if kl_in_reward and kl_coef > 0:
        kl = kl_estimate(kl_estimator, batch.old_logps, batch.ref_logps) * mask
    rewards = token_level_rewards(scores, mask, kl, kl_coef if kl is not None else 0.0)
    inputs = AdvantageInputs(token_rewards=rewards, scores=scores, response_mask=mask, values=batch.values,
                             group_ids=group_ids, gamma=gamma, lam=lam)
    advantages, returns = compute_advantages(estimator, inputs)
    if whiten_advantages != "none":
        advantages = whiten(advantages, mask, shift_mean=whiten_advantages == "whiten")
    stats = {"reward_kl_penalty": float((kl * kl_coef).sum() / mask.sum().clamp(min=1)) if kl is not None else 0.0}
    return batch.replace(advantages=advantages, returns=returns), stats


def logp_mismatch(batch: Batch) -> Optional[float]:
    """Mean |trainer log-prob - vLLM log-prob| over response tokens (same weights, same tokens)."""
    if batch.old_logps is None or batch.rollout_logps is None:
        return None
    mask = batch.loss_mask.float()
    return float(((batch.old_logps - batch.rollout_logps).abs() * mask).sum() / mask.sum().clamp(min=1))
