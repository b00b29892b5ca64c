"""Multi-turn rollouts, turn by turn across every live episode (the environment side is ``rlhf.envs``).

::

    episodes = prompt ids (+ the environment's first observation, if any), cut to the episode's token budget
    for turn in 1 .. limits.max_turns:
        every live episode's tokens so far -> the engines together (one generate call)
        each response kept as sampled, cut to the episode's token budget
        (response text, response ids) of every live episode -> environments.step together
        observation text -> encode once -> appended as context; done / over budget -> the episode ends

How an episode ends (:data:`ENDINGS`, ``EpisodeRecord.ended_by``): ``done`` when the environment says so after a
whole response; ``max_new_tokens`` when it says so after a response cut by ``rollout.max_new_tokens`` (vLLM's
``finish_reason="length"``: a response cut mid-sentence is not a clean finish, whatever the environment made of
it); ``token_budget`` when a response or observation was cut to ``max_episode_tokens`` (done or not: nothing
more fits); ``max_turns`` after the last allowed turn without done; ``prefix_mismatch`` / ``env_error``. All but
``done`` and ``env_error`` are limits (:attr:`EpisodeRecord.at_limit`, where ``rollout.episode_limit`` applies).

Seeds follow the single-turn rule: request ``j`` of a turn is drawn with ``seed + turn x TURN_SEED_STRIDE + j``
whichever engine serves it, so a rollout does not depend on ``rollout.num_engines``. Nothing is decoded and
re-encoded between turns (rlhf/rollout/episodes.py says why).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Union

from rlhf.rollout.episodes import Episode
from rlhf.rollout.observations import Messages, ObservationEncoder, Tools, as_encoder
from rlhf.rollout.types import Generation, SamplingSpec

# why an episode ended (EpisodeRecord.ended_by; the module docstring says when each applies)
ENDINGS = ("done", "max_turns", "token_budget", "max_new_tokens", "prefix_mismatch", "env_error")
LIMIT_ENDINGS = ("max_turns", "token_budget", "max_new_tokens", "prefix_mismatch")  # rollout.episode_limit applies
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
    """The engines' side: what an episode needs of a :class:`rlhf.rollout.backend.RolloutBackend`."""

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
    """One finished episode: its tokens, the environment's reward and info per turn, and why it ended."""

    episode: Episode
    turn_rewards: List[float] = field(default_factory=list)
    turn_infos: List[dict] = field(default_factory=list)  # each turn's StepOutcome.info (logged, never trained on)
    ended_by: str = "max_turns"  # one of ENDINGS
    error: str = ""  # the environment's error, when one ended the episode (on_env_error="end")

    @property
    def at_limit(self) -> bool:
        """Whether a limit ended the episode rather than the environment's done after a whole response
        (``rollout.episode_limit`` applies)."""
        return self.ended_by in LIMIT_ENDINGS

    @property
    def reward(self) -> float:
        """The environment's reward summed over the turns (final rule-based rewards are added by the caller)."""
        return float(sum(self.turn_rewards))


@dataclass
class RolloutStats:
    env_seconds: float = 0.0
    turns: int = 0  # turns run (the longest episode's)
    env_errors: int = 0  # environment failures that ended an episode (on_env_error="end")


def run_episodes(
    engines: Generator,
    environments: Environments,
    prompt_ids: Sequence[Sequence[int]],
    rows: Sequence[Mapping],
    sampling: SamplingSpec,
    encode: Union[ObservationEncoder, Callable[[str], Sequence[int]]],
    decode: Callable[[Sequence[int]], str],
    limits: TurnLimits,
    stats: Optional[RolloutStats] = None,
    on_prefix_mismatch: str = "error",
    on_env_error: str = "raise",
    prompt_messages: Optional[Sequence[Optional[Messages]]] = None,
    prompt_tools: Optional[Sequence[Tools]] = None,
) -> List[EpisodeRecord]:
    """Episode ``i`` starts from ``prompt_ids[i]`` and environment row ``rows[i]``; returns one record per episode,
    in order.

    Args:
        encode: how an observation's text becomes tokens, once (:mod:`rlhf.rollout.observations`: text or a chat
            template's observation turn); a plain ``encode(text) -> ids`` appends the text's tokens.
        decode: ``decode(ids)`` gives the environment the response's text (it also receives the ids).
        on_prefix_mismatch: for an outcome carrying ``prompt_ids`` (the whole next prompt as ids) that do not
            extend the episode's tokens: ``error`` (an :class:`~rlhf.rollout.episodes.EpisodeError` naming the
            episode, the turn and the position) or ``truncate`` (the episode ends before them, ``prefix_mismatch``).
        on_env_error: ``raise`` an environment's :class:`~rlhf.envs.EnvError` (the pool's; a raising, hung or dead
            environment) or ``end`` that episode there (``env_error``, the message in ``error``; the rest go on).
            ``end`` asks the environments for per-episode errors (``errors="return"``).
        prompt_messages: episode ``i``'s prompt as messages (``prompt_ids[i]`` is their render), aligned with
            ``prompt_ids`` and ``rows`` like them; a chat encoder renders a reset observation as their last message.
        prompt_tools: episode ``i``'s tool schemas (the row's ``tools``, which its prompt was rendered with; None
            for none), aligned like ``prompt_messages``; the reset observation's render keeps them.

    A reset observation is environment context like any other: it counts in ``limits.max_episode_tokens``, not in
    the prompt data's ``rollout.max_prompt_length`` (applied when the prompts were read; a truncated prompt stays
    truncated, :meth:`~rlhf.rollout.observations.ChatObservations.first`). A first prompt that leaves no room for a
    response is cut at the budget and ends ``token_budget`` before any turn, as a later observation would.
    """
    aligned = {"prompt messages": prompt_messages, "prompt tools": prompt_tools}
    if len(prompt_ids) != len(rows) or any(v is not None and len(v) != len(rows) for v in aligned.values()):
        raise ValueError(
            f"{len(prompt_ids)} prompts for {len(rows)} environment rows"
            + "".join(f" and {len(v)} {name}" for name, v in aligned.items() if v is not None)
        )
    encoder = as_encoder(encode)
    stats = stats if stats is not None else RolloutStats()
    if on_env_error not in ("raise", "end"):
        raise ValueError(f"on_env_error must be 'raise' or 'end', got {on_env_error!r}")
    errors = {"errors": "return"} if on_env_error == "end" else {}
    started = time.perf_counter()
    first = environments.reset(list(rows), **errors)
    stats.env_seconds += time.perf_counter() - started
    messages = prompt_messages if prompt_messages is not None else [None] * len(rows)
    tools = prompt_tools if prompt_tools is not None else [None] * len(rows)
    records = [
        _start(i, p, m, t, obs, encoder, limits, stats)
        for i, (p, m, t, obs) in enumerate(zip(prompt_ids, messages, tools, first))
    ]
    live = [i for i, r in enumerate(records) if r.ended_by != "token_budget" and not r.error]
    for turn in range(1, limits.max_turns + 1):
        if not live:
            break
        stats.turns = turn
        seeded = (
            sampling
            if sampling.seed is None
            else dataclasses.replace(sampling, seed=sampling.seed + (turn - 1) * TURN_SEED_STRIDE)
        )
        generations = engines.generate([records[i].episode.token_ids for i in live], seeded)
        cut = {i: _respond(records[i].episode, g, limits) for i, g in zip(live, generations)}
        started = time.perf_counter()
        outcomes = environments.step(
            live,
            [decode(records[i].episode.segments[-1].ids) for i in live],
            [records[i].episode.segments[-1].ids for i in live],
            **errors,
        )
        stats.env_seconds += time.perf_counter() - started
        still: List[int] = []
        for i, outcome in zip(live, outcomes):
            record = records[i]
            if isinstance(outcome, Exception):
                record.ended_by, record.error = "env_error", str(outcome)
                stats.env_errors += 1
                continue
            record.turn_rewards.append(float(outcome.reward))
            record.turn_infos.append(dict(getattr(outcome, "info", None) or {}))
            if outcome.done or cut[i] == "token_budget":  # a cut response is not a clean finish
                record.ended_by = cut[i] or "done"
            elif turn < limits.max_turns:  # at the last turn the episode ends as max_turns, observation unused
                if _observe(record, outcome, encoder, limits, on_prefix_mismatch):
                    still.append(i)
        live = still
    environments.close(list(range(len(records))))
    return records


def _start(
    index: int,
    prompt_ids: Sequence[int],
    messages: Optional[Messages],
    tools: Tools,
    observation,
    encoder: ObservationEncoder,
    limits: TurnLimits,
    stats: RolloutStats,
) -> EpisodeRecord:
    """Episode ``index``'s record before its first turn: its prompt with the reset ``observation`` (text, ``""`` /
    ``None`` for none, or the environment's exception), cut to the token budget."""
    if isinstance(observation, Exception):
        stats.env_errors += 1
        return EpisodeRecord(Episode(tuple(prompt_ids), index=index), ended_by="env_error", error=str(observation))
    ids = tuple(prompt_ids)
    if isinstance(observation, str) and observation:
        try:
            ids = tuple(encoder.first(prompt_ids, observation, messages, tools))
        except ValueError as e:
            raise ValueError(f"episode {index}'s reset observation: {e}") from None
    record = EpisodeRecord(Episode(ids[: limits.max_episode_tokens], index=index))
    if _room(record.episode, limits) <= 0:
        record.ended_by = "token_budget"
    return record


def _respond(episode: Episode, generation: Generation, limits: TurnLimits) -> str:
    """Append a response as sampled, cut to the episode's token budget; how it was cut: ``token_budget``,
    ``max_new_tokens`` (the engine stopped it at ``SamplingSpec.max_new_tokens``) or ``""`` (it ended itself)."""
    keep = min(len(generation.response_ids), _room(episode, limits))
    episode.add_response(generation.response_ids[:keep], generation.response_logps[:keep])
    if keep < len(generation.response_ids):
        return "token_budget"
    return "max_new_tokens" if generation.finish_reason == "length" else ""


def _observe(
    record: EpisodeRecord, outcome, encoder: ObservationEncoder, limits: TurnLimits, on_prefix_mismatch: str
) -> bool:
    """Append a live episode's observation (cut to its token budget); whether it goes on to another turn."""
    episode = record.episode
    prompt_ids = getattr(outcome, "prompt_ids", None)
    if prompt_ids is not None:
        budget = tuple(prompt_ids)[: limits.max_episode_tokens]
        if not episode.extend_to(budget, on_mismatch=on_prefix_mismatch):
            record.ended_by = "prefix_mismatch"
            return False
    elif outcome.observation:
        ids = encoder(outcome.observation, episode.segments[-1].ids)
        episode.add_observation(ids[: _room(episode, limits)])
    if _room(episode, limits) > 0:
        return True
    record.ended_by = "token_budget"
    return False


def _room(episode: Episode, limits: TurnLimits) -> int:
    """Tokens the episode may still add."""
    return limits.max_episode_tokens - episode.num_tokens


def episode_metrics(records: Sequence[EpisodeRecord], stats: RolloutStats) -> Dict[str, float]:
    """What a multi-turn step logs about its episodes: turns, policy vs environment tokens, how they ended, the
    environment's time."""
    n = max(len(records), 1)
    ended = {why: sum(r.ended_by == why for r in records) / n for why in ENDINGS}
    return {
        "episode/turns": sum(r.episode.turns for r in records) / n,
        "episode/policy_tokens": sum(r.episode.policy_tokens for r in records) / n,
        "episode/env_tokens": sum(r.episode.env_tokens for r in records) / n,
        "episode/env_reward": sum(r.reward for r in records) / n,
        **{f"episode/ended_{why}": share for why, share in ended.items()},
        "episode/env_errors": stats.env_errors,
        "time/env": round(stats.env_seconds, 4),
    }
