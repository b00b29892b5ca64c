"""One RL step's samples, single-turn or multi-turn, as one :class:`Rollout` (driver side; the engines and the
environment pool are actors).

* Single-turn: each prompt index is one request to the engines; a sample is ``prompt + response``. A response the
  engine cut at ``rollout.max_new_tokens`` (``finish_reason="length"``) is at a limit (``rollout.episode_limit``
  applies: DAPO's overlong filtering / punishment), counted in ``episode/ended_max_new_tokens``.
* Multi-turn (``env.spec``): each prompt index starts an episode of the environment, rolled out turn by turn
  (:func:`rlhf.rollout.multi_turn.run_episodes`); a sample is the whole episode, with loss on the policy's tokens
  only. Reward functions see the final turn's response as ``responses`` and may ask for the columns ``transcript``
  (everything after the prompt, observations included, as text) and ``turns``.

Either way request ``j`` of a (turn of a) step is drawn with ``seed + j`` whichever engine serves it. Each way is
a :class:`RolloutSource` (an agent's episodes through the endpoint: :class:`rlhf.rollout.agent.AgentRollout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from rlhf.batch import Batch
from rlhf.config.schema import ConfigError
from rlhf.envs.base import EnvError
from rlhf.rollout.backend import RolloutBackend
from rlhf.rollout.episodes import (
    EpisodeError,
    episodes_batch,
    rollout_batch,
    turn_reward_tokens,
)
from rlhf.rollout.multi_turn import EpisodeRecord, RolloutStats, TurnLimits, episode_metrics, run_episodes
from rlhf.rollout.observations import ChatObservations, TextObservations
from rlhf.rollout.prompts import PromptSet
from rlhf.rollout.types import Generation, SamplingSpec
from rlhf.utils.log import get_logger

log = get_logger(__name__)

# The columns an episode adds for the reward sources (EpisodeRollout, AgentRollout): checked against what the judge's
# template and the reward functions read before any actor starts (rlhf.trainers.preflight, rlhf.trainers.online.runner).
EPISODE_COLUMNS = ("transcript", "turns")


@dataclass
class Rollout:
    """A step's samples: ``batch`` (one row per sample or episode) and what scoring needs about each row."""

    batch: Batch
    prompt_index: List[int]  # each row's prompt (index into the PromptSet): its group for the group estimators
    responses: List[str]  # what reward functions score: the response (the final turn's, for an episode)
    columns: Dict[str, list] = field(default_factory=dict)  # extra reward-function columns (transcript, turns)
    env_rewards: Optional[torch.Tensor] = None  # (B,) the environment's rewards summed over each episode's turns
    # (B, T) each turn's environment reward at that turn's last policy token (algo.turn_credit=turn reads it)
    turn_rewards: Optional[torch.Tensor] = None
    # (B,) bool: a limit ended the episode, or cut the single-turn response (rollout.episode_limit applies)
    at_limit: Optional[torch.Tensor] = None
    failed: Optional[torch.Tensor] = None  # (B,) bool: the environment failed in the episode (env.on_error=drop)
    # (B,) bool: a reward source failed on the sample (reward.on_error=drop): its group carries no loss
    reward_failed: Optional[torch.Tensor] = None
    metrics: Dict[str, float] = field(default_factory=dict)  # episode/* (single-turn: episode/ended_max_new_tokens)
    # (B, T) int64 with rollout.max_staleness >= 1: the weight version that sampled each token, -1 on tokens the
    # policy did not sample (prompt, observations, padding); rlhf.trainers.online.schedule
    token_versions: Optional[torch.Tensor] = None
    # the summed reward and each source's, when they were computed with the samples (dynamic sampling picks groups
    # by them); None: the step scores them
    scored: Optional[Tuple[torch.Tensor, Dict[str, torch.Tensor]]] = None

    def failures(self) -> Optional[torch.Tensor]:
        """``(B,)`` bool: the samples that failed, a reward source's (``reward.on_error=drop``) or the environment's
        or agent's (``env.on_error=drop``); ``None`` when neither can fail. Their rewards are placeholders: the step
        leaves them out of every statistic (:mod:`rlhf.ops.failures`)."""
        parts = [x for x in (self.failed, self.reward_failed) if x is not None]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else parts[0] | parts[1]

    def select(self, rows: Sequence[int]) -> "Rollout":
        """A single-turn rollout's ``rows``, in that order (its metric recomputed from them)."""
        self._single_turn("select")
        index = torch.as_tensor(list(rows), dtype=torch.long)
        at_limit = self.at_limit[index] if self.at_limit is not None else None
        return Rollout(
            self.batch.select(rows),
            [self.prompt_index[i] for i in rows],
            [self.responses[i] for i in rows],
            columns={k: [v[i] for i in rows] for k, v in self.columns.items()},
            at_limit=at_limit,
            reward_failed=None if self.reward_failed is None else self.reward_failed[index],
            metrics=_cut_metrics(at_limit),
            scored=None
            if self.scored is None
            else (self.scored[0][index], {k: v[index] for k, v in self.scored[1].items()}),
        )

    @staticmethod
    def concat(parts: Sequence["Rollout"], pad_id: int) -> "Rollout":
        """Single-turn rollouts one after the other (sequence fields right-padded with ``pad_id``)."""
        for part in parts:
            part._single_turn("concat")
        limits = [p.at_limit for p in parts]
        at_limit = torch.cat([x for x in limits if x is not None]) if all(x is not None for x in limits) else None
        scored = None
        if all(p.scored is not None for p in parts):
            totals = torch.cat([p.scored[0] for p in parts if p.scored is not None])
            keys = [k for p in parts if p.scored is not None for k in p.scored[1]]
            per_source = {
                k: torch.cat([p.scored[1][k] for p in parts if p.scored is not None]) for k in dict.fromkeys(keys)
            }
            scored = (totals, per_source)
        failed = [p.reward_failed for p in parts]
        reward_failed = torch.cat([x for x in failed if x is not None]) if all(x is not None for x in failed) else None
        return Rollout(
            Batch.concat([p.batch for p in parts], pad_id=pad_id),
            [i for p in parts for i in p.prompt_index],
            [s for p in parts for s in p.responses],
            columns={k: [v for p in parts for v in p.columns[k]] for k in parts[0].columns},
            at_limit=at_limit,
            reward_failed=reward_failed,
            metrics=_cut_metrics(at_limit),
            scored=scored,
        )

    def _single_turn(self, what: str) -> None:
        if self.env_rewards is not None or self.failed is not None or self.token_versions is not None:
            raise ValueError(f"Rollout.{what} takes single-turn rollouts before their versions are recorded")


class RolloutSource(Protocol):
    """Where an RL step's samples come from: :class:`SingleTurnRollout` (one prompt, one response),
    :class:`EpisodeRollout` (an environment's episodes, turn by turn) and :class:`rlhf.rollout.agent.AgentRollout`
    (an agent's episodes through the endpoint). The trainer holds one and calls it the same way whatever it is;
    a new rollout mode is a class with this call (docs/extending.md)."""

    def __call__(
        self, engines: RolloutBackend, prompts: PromptSet, prompt_index: List[int], sampling: SamplingSpec, step: int
    ) -> Rollout:
        """Sample ``j`` answers prompt ``prompt_index[j]`` of ``prompts``, drawn with ``sampling`` (request ``j``
        with seed ``sampling.seed + j``) on ``engines``; ``step`` names the RL step in errors."""
        ...


class SingleTurnRollout:
    """One response per prompt index: each is one request to the engines, a sample ``prompt + response``."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(
        self, engines: RolloutBackend, prompts: PromptSet, prompt_index: List[int], sampling: SamplingSpec, step: int
    ) -> Rollout:
        generations = engines.generate([prompts.prompt_ids[i] for i in prompt_index], sampling)
        return single_turn_of(generations, self.tokenizer, prompt_index)


def single_turn_of(generations: Sequence[Generation], tokenizer, prompt_index: List[int]) -> Rollout:
    """The rollout of single-turn ``generations`` (``prompt_index[j]``: generation ``j``'s prompt)."""
    responses = tokenizer.batch_decode([list(g.response_ids) for g in generations], skip_special_tokens=True)
    cut = torch.tensor([g.finish_reason == "length" for g in generations], dtype=torch.bool)
    return Rollout(
        rollout_batch(generations, tokenizer.pad_token_id),
        prompt_index,
        responses,
        at_limit=cut,
        metrics=_cut_metrics(cut),
    )


def continued(first: Sequence[Generation], going: Sequence[int], rest: Sequence[Generation]) -> List[Generation]:
    """Partial rollouts: each of ``first`` (the responses' first tokens), response ``going[k]`` continued by
    ``rest[k]`` (sampled from its prompt and first tokens): tokens and sampling log-probs joined, the finish
    reason the continuation's."""
    whole = list(first)
    for j, tail in zip(going, rest):
        g = first[j]
        whole[j] = Generation(
            g.prompt_ids, g.response_ids + tail.response_ids, g.response_logps + tail.response_logps, tail.finish_reason
        )
    return whole


def spanned_versions(
    first: Sequence[Generation], whole: Sequence[Generation], shape: Sequence[int], version: int
) -> torch.Tensor:
    """``(B, T)`` int64: the weight version of each sampled token of ``whole`` laid out as :func:`single_turn_of`
    lays it out: ``version`` on the tokens of ``first``, ``version + 1`` on their continuation, -1 elsewhere."""
    versions = torch.full(tuple(shape), -1, dtype=torch.long)
    for j, (g, w) in enumerate(zip(first, whole)):
        start, cut = len(g.prompt_ids), len(g.prompt_ids) + len(g.response_ids)
        versions[j, start:cut], versions[j, cut : len(w.prompt_ids) + len(w.response_ids)] = version, version + 1
    return versions


def _cut_metrics(cut: Optional[torch.Tensor]) -> Dict[str, float]:
    """A single-turn rollout's ``episode/ended_max_new_tokens``: the share of responses cut at the budget."""
    if cut is None:
        return {}
    return {"episode/ended_max_new_tokens": cut.float().mean().item() if len(cut) else 0.0}


class EpisodeRollout:
    """Multi-turn rollouts of one environment pool (``env.*``, the ``rollout.*`` episode keys).

    Args:
        pool: the :class:`~rlhf.envs.EnvironmentPool` (or any object with its ``reset`` / ``step`` / ``close``).
        tokenizer: decodes responses for the environment and reward functions; encodes text observations.
        observation_format: ``text`` or ``chat`` (resolved from ``auto`` by :func:`observation_format`).
        observation_role: the chat role of observations.
        limits: turns and tokens per episode.
        on_prefix_mismatch: ``error`` | ``truncate`` for environments returning ``prompt_ids``.
        on_error: ``fail`` (an environment's error stops the run) | ``drop`` (ends that episode only).
    """

    def __init__(
        self,
        pool,
        tokenizer,
        observation_format: str,
        observation_role: str,
        limits: TurnLimits,
        on_prefix_mismatch: str,
        on_error: str = "fail",
    ) -> None:
        self.pool, self.tokenizer, self.limits = pool, tokenizer, limits
        self.format, self.role, self.on_prefix_mismatch = observation_format, observation_role, on_prefix_mismatch
        self.on_error = on_error

    def encoder(self, prompts: PromptSet):
        if self.format == "chat":
            return ChatObservations(prompts.chat, self.role)
        return TextObservations.of(self.tokenizer)

    def __call__(
        self, engines, prompts: PromptSet, prompt_index: List[int], sampling: SamplingSpec, step: int
    ) -> Rollout:
        """Episode ``j`` answers prompt ``prompt_index[j]``: its prompt ids, environment row and messages (for a
        reset observation) are that prompt's; ``step`` names the RL step in errors (0: evaluation)."""
        stats = RolloutStats()
        decode = lambda ids: self.tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
        messages, tools = prompts.messages, prompts.tools
        try:
            records = run_episodes(
                engines,
                self.pool,
                [prompts.prompt_ids[i] for i in prompt_index],
                [prompts.env_rows[i] for i in prompt_index],
                sampling,
                self.encoder(prompts),
                decode,
                self.limits,
                stats,
                on_prefix_mismatch=self.on_prefix_mismatch,
                on_env_error="end" if self.on_error == "drop" else "raise",
                prompt_messages=[messages[i] for i in prompt_index],
                prompt_tools=[tools[i] for i in prompt_index],
            )
        except EnvError as e:
            raise EnvError(
                f"{where_in_run(step)}: {e} (env.step_timeout_s={self.pool.step_timeout_s:g})",
                e.spec,
                e.episode,
                e.turn,
            ) from e
        except EpisodeError as e:  # a re-tokenizing environment (rollout.on_prefix_mismatch=error)
            raise EpisodeError(f"{where_in_run(step)}: {e}") from e
        failed = [r for r in records if r.error]
        if failed:  # the run goes on without them (env.on_error=drop); say what happened, once per step
            log.info(
                f"[rl] {where_in_run(step)}: {len(failed)} of {len(records)} "
                f"episodes ended by an environment error (env.on_error=drop), the first: {failed[0].error}"
            )
        episodes = [r.episode for r in records]
        batch = episodes_batch(episodes, self.tokenizer.pad_token_id)
        return Rollout(
            batch,
            prompt_index,
            responses=[decode(last_response(r)) for r in records],
            columns={
                "transcript": [decode(r.episode.token_ids[len(r.episode.prompt_ids) :]) for r in records],
                "turns": [r.episode.turns for r in records],
            },
            env_rewards=torch.tensor([r.reward for r in records], dtype=torch.float32),
            turn_rewards=turn_reward_tokens(episodes, [r.turn_rewards for r in records], batch.input_ids.shape[1]),
            at_limit=torch.tensor([r.at_limit for r in records], dtype=torch.bool),
            failed=torch.tensor([bool(r.error) for r in records], dtype=torch.bool),
            metrics={
                **without_key(episode_metrics(records, stats), "episode/env_reward"),  # = reward/env
                **_turn_rewards(records),
            },
        )


def where_in_run(step: int) -> str:
    return f"RL step {step}" if step else "the evaluation"


def without_key(metrics: Dict[str, float], key: str) -> Dict[str, float]:
    return {k: v for k, v in metrics.items() if k != key}


def last_response(record: EpisodeRecord) -> Sequence[int]:
    policy = [s for s in record.episode.segments if s.source == "policy"]
    return policy[-1].ids if policy else ()


def _turn_rewards(records: Sequence[EpisodeRecord]) -> Dict[str, float]:
    """``episode/reward_turn_<t>``: the environment's mean reward at turn t over the episodes that took it."""
    out: Dict[str, float] = {}
    longest = max((len(r.turn_rewards) for r in records), default=0)
    for t in range(longest):
        got = [r.turn_rewards[t] for r in records if len(r.turn_rewards) > t]
        out[f"episode/reward_turn_{t + 1}"] = sum(got) / len(got)
    return out


def observation_format(setting: str, conversational: bool) -> str:
    """``rollout.observation_format`` resolved: ``auto`` is ``chat`` for conversational prompts, else ``text``;
    ``chat`` without conversational prompts is refused (there is no conversation to add a message to)."""
    if setting == "auto":
        return "chat" if conversational else "text"
    if setting == "chat" and not conversational:
        raise ConfigError(
            "rollout.observation_format=chat needs conversational prompts (data.prompt_key holding "
            "lists of messages) rendered by a chat template; these prompts are plain text: use text "
            "or auto"
        )
    return setting


def staleness_metrics(step: int, versions: torch.Tensor, times) -> Dict[str, float]:
    """``async/*`` of step ``step``: how many versions the sampled tokens lag the policy that trains on them
    (``step - 1``), the versions one sample spans, and the schedule's ``times`` (seconds waited on generation,
    generation run ahead). ``versions``: ``(B, T)`` the version of each sampled token, -1 elsewhere."""
    sampled = versions >= 0
    lag = (step - 1 - versions)[sampled].float()
    rows = sampled.any(-1)
    span = versions.masked_fill(~sampled, -1).amax(-1) - versions.masked_fill(~sampled, 1 << 30).amin(-1)
    return {
        "async/staleness_mean": float(lag.mean()) if len(lag) else 0.0,
        "async/staleness_max": float(lag.max()) if len(lag) else 0.0,
        "async/version_span": float(span[rows].float().mean()) if bool(rows.any()) else 0.0,
        "async/waited_s": round(times.waited, 4),
        "async/generated_ahead_s": round(times.ahead, 4),
    }
