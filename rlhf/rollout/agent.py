"""One RL step's episodes when ``env.spec`` names an agent function (:mod:`rlhf.envs.agents`): each episode's agent
talks to the policy through its own URL of the endpoint (:mod:`rlhf.rollout.openai.endpoint`), and the episode trained
on is the chain of tokens the engines were given and sampled (:mod:`rlhf.rollout.transcripts`).

::

    for every episode j of the step: a URL of the endpoint, seeds seed + j x AGENT_SEED_STRIDE + request
    the environment actors run every agent at once (the endpoint batches their requests into engine calls)
    each agent returns its reward; each episode's transcript -> its tokens, loss on the policy's replies only

An episode ends ``done`` when its agent returns (a request beyond ``rollout.max_turns`` is refused with a 400,
counted in ``agent/refused``: the agent then stops or fails); ``token_budget`` when a request found no room left in
``rollout.max_episode_tokens``; ``max_new_tokens`` when its last reply was cut at ``rollout.max_new_tokens``;
``prefix_mismatch`` when the agent broke the token chain (``rollout.on_prefix_mismatch=truncate`` trains the chain
up to there; ``error`` stops the run naming the episode and why); ``env_error`` when the agent raised or hung
(``env.on_error``). ``episode/broken_chains`` counts the episodes whose chain broke, every step (0 when none).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import torch

from rlhf.envs.base import EnvError
from rlhf.rollout.episodes import Episode, EpisodeError, episodes_batch
from rlhf.rollout.multi_turn import EpisodeRecord, RolloutStats, episode_metrics
from rlhf.rollout.prompts import PromptSet
from rlhf.rollout.sources import Rollout, last_response, where_in_run, without_key
from rlhf.rollout.transcripts import EpisodeTranscript
from rlhf.rollout.types import SamplingSpec
from rlhf.utils.log import get_logger

log = get_logger(__name__)

AGENT_SEED_STRIDE = 1_000_003  # episode j's requests are seeded from seed + j x stride (an episode makes fewer)


class AgentRollout:
    """Episodes of an agent function on the environment pool, through the endpoint.

    Args:
        pool: the :class:`~rlhf.envs.EnvironmentPool` hosting the agent function.
        endpoint: the started :class:`~rlhf.rollout.openai.endpoint.AgentEndpoint` over the run's engines.
        tokenizer: decodes the final replies and transcripts for the reward functions.
        max_episode_tokens: each episode's token budget (``rollout.max_episode_tokens``).
        max_turns: the requests each episode may make (``rollout.max_turns``); one more is refused with a 400.
        on_prefix_mismatch: ``error`` | ``truncate`` for an agent that breaks the token chain.
        on_error: ``fail`` | ``drop`` for an agent that raises or hangs (``env.on_error``).
    """

    def __init__(
        self,
        pool,
        endpoint,
        tokenizer,
        max_episode_tokens: int,
        max_turns: int,
        on_prefix_mismatch: str,
        on_error: str,
    ) -> None:
        self.pool, self.endpoint, self.tokenizer = pool, endpoint, tokenizer
        self.max_episode_tokens, self.max_turns = max_episode_tokens, max_turns
        self.on_prefix_mismatch, self.on_error = on_prefix_mismatch, on_error

    def __call__(
        self, engines, prompts: PromptSet, prompt_index: List[int], sampling: SamplingSpec, step: int
    ) -> Rollout:
        """Episode ``j`` answers prompt ``prompt_index[j]`` (its row goes to the agent); ``step`` names the RL step in
        errors (0: evaluation). ``engines`` are the endpoint's already."""
        self.endpoint.sampling = dataclasses.replace(sampling, seed=None)  # the trainer's sampling, this step's
        seeds = [
            None if sampling.seed is None else sampling.seed + j * AGENT_SEED_STRIDE for j in range(len(prompt_index))
        ]
        before, started = _counts(self.endpoint), time.perf_counter()
        urls = [self.endpoint.open(j, seed, self.max_episode_tokens, self.max_turns) for j, seed in enumerate(seeds)]
        try:
            results = self.pool.run_agents(
                urls, [prompts.env_rows[i] for i in prompt_index], "return" if self.on_error == "drop" else "raise"
            )
        except EnvError as e:
            raise EnvError(f"{where_in_run(step)}: {e}", e.spec, e.episode, e.turn) from e
        finally:
            sessions = [self.endpoint.close(url) for url in urls]
        records = [
            self._record(j, session, result, prompts.prompt_ids[prompt_index[j]], step)
            for j, (session, result) in enumerate(zip(sessions, results))
        ]
        errors = [r for r in results if isinstance(r, EnvError)]
        if errors:
            log.info(
                f"[rl] {where_in_run(step)}: {len(errors)} of {len(results)} agents failed (env.on_error=drop), "
                f"the first: {errors[0]}"
            )
        episodes = [r.episode for r in records]
        batch = episodes_batch(episodes, self.tokenizer.pad_token_id)
        decode = lambda ids: self.tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
        stats = RolloutStats(env_seconds=time.perf_counter() - started, env_errors=len(errors))
        return Rollout(
            batch,
            prompt_index,
            responses=[decode(last_response(r)) for r in records],
            columns={
                "transcript": [decode(e.token_ids[len(e.prompt_ids) :]) for e in episodes],
                "turns": [e.turns for e in episodes],
            },
            env_rewards=torch.tensor([r.reward for r in records], dtype=torch.float32),
            turn_rewards=torch.zeros(batch.input_ids.shape, dtype=torch.float32),
            at_limit=torch.tensor([r.at_limit for r in records], dtype=torch.bool),
            failed=torch.tensor([bool(r.error) for r in records], dtype=torch.bool),
            metrics={
                **without_key(episode_metrics(records, stats), "episode/env_reward"),  # = reward/env
                "episode/broken_chains": float(broken_chains([s.transcript for s in sessions])),
                **_counts(self.endpoint, minus=before),
            },
        )

    def _record(self, j: int, session, result, prompt_ids: Sequence[int], step: int) -> EpisodeRecord:
        """Episode ``j``'s tokens, the agent's reward (its one turn reward) and why it ended. An agent that failed,
        or made no request, is an episode of its prompt alone that ends ``env_error`` (no loss: it is failed)."""
        transcript = session.transcript
        if isinstance(result, EnvError) or not transcript.exchanges:
            if not isinstance(result, EnvError) and self.on_error != "drop":
                raise EnvError(f"{where_in_run(step)}: agent episode {j} made no request to its endpoint", None, j)
            error = str(result) if isinstance(result, EnvError) else f"agent episode {j} made no request"
            return EpisodeRecord(Episode(tuple(prompt_ids), index=j), ended_by="env_error", error=error)
        try:
            episode = transcript.episode(self.on_prefix_mismatch)
        except EpisodeError as e:
            raise EpisodeError(f"{where_in_run(step)}: {e}") from e
        if episode.truncated:
            why = "prefix_mismatch"
        elif session.exhausted:
            why = "token_budget"
        else:
            why = "max_new_tokens" if transcript.exchanges[-1].finish_reason == "length" else "done"
        return EpisodeRecord(episode, turn_rewards=[result.reward], ended_by=why)


def broken_chains(transcripts: Sequence[EpisodeTranscript]) -> int:
    """How many episodes' token chains broke (a request that did not continue the last exchange), whatever became
    of them: logged every step, 0 when none, because ``episode/ended_prefix_mismatch`` counts only the episodes
    ``rollout.on_prefix_mismatch=truncate`` cut (under ``error`` such an episode stops the run, and an agent that
    then failed ends ``env_error``, its break counted here alone)."""
    return sum(bool(t.breaks) for t in transcripts)


def _counts(endpoint, minus: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """The endpoint's ``agent/*`` figures so far (less ``minus``: one step's): requests served, refused, engine
    calls they were batched into, the wall seconds with a request in flight (``agent/endpoint_s``: the union of the
    requests' intervals, :class:`~rlhf.rollout.openai.endpoint.BusyClock`) and the requests' seconds summed
    (``agent/request_s_sum``: more than the wall time when requests overlap; divided by ``agent/endpoint_s``, the
    mean number in flight)."""
    now = {
        "agent/requests": float(endpoint.stats.requests),
        "agent/refused": float(endpoint.stats.refused),
        "agent/engine_calls": float(endpoint.batcher.calls),
        "agent/endpoint_s": float(endpoint.busy.seconds()),
        "agent/request_s_sum": float(endpoint.stats.seconds),
    }
    return {k: v - (minus or {}).get(k, 0.0) for k, v in now.items()}
