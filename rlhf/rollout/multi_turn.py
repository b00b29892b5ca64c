"""Multi-turn rollouts, turn by turn across every live episode (the environment side is ``rlhf.envs``).

::

    episodes = prompt ids (+ the environment's first observation, if any)
    for turn in 1 .. limits.max_turns:
        every live episode's tokens so far -> the engines together (one generate call)
        each response kept as sampled, cut to the episode's token budget
        (response text, response ids) of every live episode -> environments.step together
        observation text -> encode once -> appended as context; done / over budget -> the episode ends

Seeds follow the single-turn rule: request ``j`` of a turn is drawn with ``seed + turn x TURN_SEED_STRIDE + j``
whichever engine serves it, so a rollout does not depend on ``rollout.num_engines``. Nothing is decoded and
re-encoded between turns (rlhf/rollout/episodes.py says why).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Sequence

from rlhf.rollout.episodes import Episode
from rlhf.rollout.vllm_engine import Generation, SamplingSpec

TURN_SEED_STRIDE = 1_000_003  # turn t's seeds sit far from turn t-1's (a turn has far fewer requests)


class Environments(Protocol):
    """A batch of environment episodes (``rlhf.envs``' pool, or any object with these methods).

    ``reset(rows)`` starts one episode per row and returns each first observation (text; ``""`` for none);
    ``step(episode_ids, responses, response_ids)`` advances the given episodes one turn together and returns one
    outcome per episode with ``observation``, ``reward``, ``done``; ``close(episode_ids)`` ends them.
    """

    def reset(self, rows: Sequence[Mapping]) -> List[str]: ...

    def step(self, episode_ids: Sequence[int], responses: Sequence[str], response_ids: Sequence[tuple]) -> list: ...

    def close(self, episode_ids: Sequence[int]) -> None: ...


class Generator(Protocol):
    """The engines' side (:class:`rlhf.rollout.engines.RolloutEngines`)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingSpec) -> List[Generation]: ...


@dataclass(frozen=True)
class TurnLimits:
    """``max_turns`` policy turns per episode; ``max_episode_tokens`` tokens in all (prompt, responses and
    observations: what the engine's context and the trainer's row must hold)."""

    max_turns: int
    max_episode_tokens: int

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_episode_tokens < 2:
            raise ValueError(f"TurnLimits needs max_turns >= 1 and max_episode_tokens >= 2, got {self}")


@dataclass
class EpisodeRecord:
    """One finished episode: its tokens, the environment's reward per turn, and why it ended."""

    episode: Episode
    turn_rewards: List[float] = field(default_factory=list)
    ended_by: str = "max_turns"  # done | max_turns | token_budget

    @property
    def reward(self) -> float:
        """The environment's reward summed over the turns (final rule-based rewards are added by the caller)."""
        return float(sum(self.turn_rewards))


@dataclass
class RolloutStats:
    env_seconds: float = 0.0
    turns: int = 0  # turns run (the longest episode's)


def run_episodes(engines: Generator, environments: Environments, prompt_ids: Sequence[Sequence[int]],
                 rows: Sequence[Mapping], sampling: SamplingSpec, encode: Callable[[str], List[int]],
                 decode: Callable[[Sequence[int]], str], limits: TurnLimits,
                 stats: Optional[RolloutStats] = None) -> List[EpisodeRecord]:
    """Episode ``i`` starts from ``prompt_ids[i]`` and environment row ``rows[i]``; returns one record per episode,
    in order. ``encode(text) -> ids`` tokenizes an observation once (a chat template's observation turn, or plain
    text); ``decode(ids)`` gives the environment the response's text (it also receives the ids)."""
    if len(prompt_ids) != len(rows):
        raise ValueError(f"{len(prompt_ids)} prompts for {len(rows)} environment rows")
    stats = stats if stats is not None else RolloutStats()
    records = [EpisodeRecord(Episode(tuple(p), index=i)) for i, p in enumerate(prompt_ids)]
    started = time.perf_counter()
    first = environments.reset(list(rows))
    stats.env_seconds += time.perf_counter() - started
    for record, observation in zip(records, first):
        if observation:
            record.episode.add_observation(encode(observation))
    live = [i for i, r in enumerate(records) if _room(r.episode, limits) > 0]
    for i in set(range(len(records))) - set(live):
        records[i].ended_by = "token_budget"
    for turn in range(1, limits.max_turns + 1):
        if not live:
            break
        stats.turns = turn
        seeded = sampling if sampling.seed is None else dataclasses.replace(
            sampling, seed=sampling.seed + (turn - 1) * TURN_SEED_STRIDE)
        generations = engines.generate([records[i].episode.token_ids for i in live], seeded)
        for i, g in zip(live, generations):
            keep = min(len(g.response_ids), _room(records[i].episode, limits))
            records[i].episode.add_response(g.response_ids[:keep], g.response_logps[:keep])
        started = time.perf_counter()
        outcomes = environments.step(live, [decode(records[i].episode.segments[-1].ids) for i in live],
                                     [records[i].episode.segments[-1].ids for i in live])
        stats.env_seconds += time.perf_counter() - started
        still: List[int] = []
        for i, outcome in zip(live, outcomes):
            record = records[i]
            record.turn_rewards.append(float(outcome.reward))
            if outcome.done:
                record.ended_by = "done"
            elif turn < limits.max_turns:  # at the last turn the episode ends as max_turns, observation unused
                if outcome.observation:
                    record.episode.add_observation(encode(outcome.observation)[:_room(record.episode, limits)])
                if _room(record.episode, limits) > 0:
                    still.append(i)
                else:
                    record.ended_by = "token_budget"
        live = still
    environments.close(list(range(len(records))))
    return records


def _room(episode: Episode, limits: TurnLimits) -> int:
    """Tokens the episode may still add."""
    return limits.max_episode_tokens - episode.num_tokens


def episode_metrics(records: Sequence[EpisodeRecord], stats: RolloutStats) -> Dict[str, float]:
    """What a multi-turn step logs about its episodes: turns, policy vs environment tokens, how they ended, the
    environment's time."""
    n = max(len(records), 1)
    ended = {why: sum(r.ended_by == why for r in records) / n for why in ("done", "max_turns", "token_budget")}
    return {"episode/turns": sum(r.episode.turns for r in records) / n,
            "episode/policy_tokens": sum(r.episode.policy_tokens for r in records) / n,
            "episode/env_tokens": sum(r.episode.env_tokens for r in records) / n,
            "episode/env_reward": sum(r.reward for r in records) / n,
            **{f"episode/ended_{why}": share for why, share in ended.items()},
            "time/env": round(stats.env_seconds, 4)}
