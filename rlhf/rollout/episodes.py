"""Episodes kept token-in / token-out: what the policy sampled stays as sampled, observations are appended once.

An episode is a prompt followed by segments, each either **policy** tokens (sampled by the engine, with their
sampling log-probs) or **environment** tokens (an observation, tokenized once). The next turn's prompt is the
episode's tokens so far (:attr:`Episode.token_ids`): nothing is decoded and re-encoded between turns, so the
tokens trained on are exactly the tokens sampled (re-encoding text drifts: "ab" sampled as ``[a, b]`` may come
back as ``[ab]``, and the log-probs no longer belong to the tokens).

An environment (or a chat template) that hands back the *whole* conversation as token ids goes through
:meth:`Episode.extend_to`, which checks that the new ids extend the episode's tokens and keeps only the new suffix
as the observation; where they do not (a re-tokenizing environment), it names the episode, the turn and the first
differing position, or truncates the episode there (``on_mismatch="truncate"``).

:func:`episodes_batch` lays episodes out as one right-padded train batch: ``loss_mask`` is 1 on policy tokens only,
so environment tokens are context: no loss, no log-prob ratio, no KL, no advantage, and they are not counted by any
loss aggregation. An episode is one row (one sample) whatever its number of turns. A single-turn rollout is the
episode ``prompt + one policy segment`` (:func:`rollout_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from rlhf.batch import Batch, pad_sequences

POLICY, ENV = "policy", "env"


class EpisodeError(ValueError):
    """An episode whose tokens cannot be kept exact; the message names the episode and the turn."""


@dataclass(frozen=True)
class Segment:
    """A run of tokens of one source: ``policy`` (sampled; ``logps[i]`` is the sampling log-prob of ``ids[i]``) or
    ``env`` (an observation; no log-probs)."""

    source: str
    ids: Tuple[int, ...]
    logps: Optional[Tuple[float, ...]] = None

    def __post_init__(self) -> None:
        if self.source not in (POLICY, ENV):
            raise ValueError(f"Segment.source must be {POLICY!r} or {ENV!r}, got {self.source!r}")
        if self.source == POLICY and (self.logps is None or len(self.logps) != len(self.ids)):
            raise ValueError(
                f"a policy segment needs one sampling log-prob per token: {len(self.ids)} tokens, "
                f"{None if self.logps is None else len(self.logps)} log-probs"
            )
        if self.source == ENV and self.logps is not None:
            raise ValueError("an environment segment has no log-probs: the policy did not sample it")


@dataclass
class Episode:
    """One episode: ``prompt_ids``, then the segments in order. ``index`` names it in errors."""

    prompt_ids: Tuple[int, ...]
    index: int = 0
    segments: List[Segment] = field(default_factory=list)
    truncated: bool = False  # extend_to cut the episode at a mismatch (on_mismatch="truncate")

    @property
    def token_ids(self) -> Tuple[int, ...]:
        """Every token so far, as the engine saw and produced them: the next turn's prompt."""
        return tuple(self.prompt_ids) + tuple(t for s in self.segments for t in s.ids)

    @property
    def num_tokens(self) -> int:
        """``len(token_ids)``, without building them."""
        return len(self.prompt_ids) + sum(len(s.ids) for s in self.segments)

    @property
    def turns(self) -> int:
        """Policy turns so far."""
        return sum(s.source == POLICY for s in self.segments)

    @property
    def policy_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments if s.source == POLICY)

    @property
    def env_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments if s.source == ENV)

    def add_response(self, ids: Sequence[int], logps: Sequence[float]) -> None:
        """The policy's sampled tokens of this turn, as sampled."""
        self.segments.append(Segment(POLICY, tuple(ids), tuple(float(x) for x in logps)))

    def add_observation(self, ids: Sequence[int]) -> None:
        """An observation's tokens (tokenized once by the caller), appended as context."""
        if ids:
            self.segments.append(Segment(ENV, tuple(ids)))

    def extend_to(self, full_ids: Sequence[int], on_mismatch: str = "error") -> bool:
        """Take the whole conversation as ids: they must start with :attr:`token_ids`; the rest is appended as the
        observation. Returns False when they did not and ``on_mismatch="truncate"`` ended the episode there (its
        tokens so far are kept; :attr:`truncated` is set). ``on_mismatch="error"`` raises :class:`EpisodeError`."""
        if on_mismatch not in ("error", "truncate"):
            raise ValueError(f"on_mismatch must be 'error' or 'truncate', got {on_mismatch!r}")
        have, full = self.token_ids, tuple(full_ids)
        at = first_difference(have, full)
        if at is None:
            self.add_observation(full[len(have) :])
            return True
        if on_mismatch == "truncate":
            self.truncated = True
            return False
        shown = lambda ids: list(ids[max(0, at - 2) : at + 3])  # noqa: E731
        raise EpisodeError(
            f"episode {self.index}, turn {self.turns}: the new prompt does not extend the episode's tokens: they "
            f"differ at position {at} of {len(have)} (had {shown(have)}, got {shown(full)} around it); something "
            f"re-encoded the text (the environment or the chat template). Append the observation's own ids, or end "
            f"such episodes at the mismatch (rollout.on_prefix_mismatch=truncate)"
        )


def first_difference(prefix: Tuple[int, ...], full: Tuple[int, ...]) -> Optional[int]:
    """The first position where ``full`` does not continue ``prefix`` (``None``: it does)."""
    for i, token in enumerate(prefix):
        if i >= len(full) or full[i] != token:
            return i
    return None


def episodes_batch(episodes: Sequence[Episode], pad_id: int) -> Batch:
    """Episodes -> one right-padded ``(B, T)`` batch, one row per episode.

    ``input_ids`` = prompt + every segment; ``loss_mask`` = 1 on policy tokens only; ``rollout_logps`` = the
    engine's sampling log-probs on the policy tokens (0 elsewhere); ``sample_index`` = the episode's position.
    """
    seqs = [list(e.token_ids) for e in episodes]
    ids = pad_sequences(seqs, pad_id)
    mask = torch.zeros_like(ids)
    rollout = torch.zeros(ids.shape, dtype=torch.float32)
    for row, episode in enumerate(episodes):
        start = len(episode.prompt_ids)
        for segment in episode.segments:
            end = start + len(segment.ids)
            if segment.source == POLICY:
                mask[row, start:end] = 1
                rollout[row, start:end] = torch.tensor(segment.logps, dtype=torch.float32)
            start = end
    return Batch(
        input_ids=ids,
        attention_mask=pad_sequences([[1] * len(s) for s in seqs], 0, ids.shape[1]),
        loss_mask=mask,
        rollout_logps=rollout,
        sample_index=torch.arange(len(seqs)),
    )


def turn_reward_tokens(
    episodes: Sequence[Episode], turn_rewards: Sequence[Sequence[float]], width: int
) -> torch.Tensor:
    """Each turn's reward at the last token of that turn's response, laid out as :func:`episodes_batch` lays out the
    episodes: ``(B, width)`` float32, 0 elsewhere (``algo.turn_credit=turn``).

    ``turn_rewards[b][t]`` is episode ``b``'s reward after its ``t``-th policy segment. A turn whose response is
    empty (cut to nothing by the token budget) has its reward at the latest policy token before it; with none
    before it, the reward is not placed here and so stays with the episode's score at its last token
    (:func:`rlhf.ops.advantages.token_level_rewards`).
    """
    if len(turn_rewards) != len(episodes):
        raise ValueError(f"{len(turn_rewards)} lists of turn rewards for {len(episodes)} episodes")
    out = torch.zeros(len(episodes), width, dtype=torch.float32)
    for row, (episode, rewards) in enumerate(zip(episodes, turn_rewards)):
        ends, start, last = [], len(episode.prompt_ids), -1
        for segment in episode.segments:
            start += len(segment.ids)
            if segment.source == POLICY:
                last = start - 1 if segment.ids else last
                ends.append(last)
        if len(rewards) > len(ends):
            raise ValueError(f"episode {episode.index}: {len(rewards)} turn rewards for {len(ends)} policy turns")
        for end, reward in zip(ends, rewards):
            if end >= 0:
                out[row, end] += float(reward)
    return out


def rollout_batch(generations: Sequence, pad_id: int) -> Batch:
    """Single-turn generations (``rlhf.rollout.types.Generation``) -> one right-padded ``(B, T)`` batch.

    Each is the episode ``prompt + response`` (:func:`rlhf.rollout.episodes.episodes_batch`): ``input_ids`` =
    prompt + response, ``loss_mask`` on the response tokens, ``rollout_logps`` = the engine's sampling log-probs
    placed on the response columns, ``sample_index`` = the generation's position.
    """
    episodes = []
    for i, g in enumerate(generations):
        episode = Episode(tuple(g.prompt_ids), index=i)
        episode.add_response(g.response_ids, g.response_logps)
        episodes.append(episode)
    return episodes_batch(episodes, pad_id)
