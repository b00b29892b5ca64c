"""An RL step's reward, in one room: every source of it behind one protocol, then the shaping and the limits.

A :class:`RewardSource` scores a step's samples (:class:`Samples`) and reports what it adds to each sample's
reward, its own values by name (``reward/<name>`` in the metrics), the samples it failed on and its own metrics:

* :class:`EnvironmentReward`: an environment's (or an agent's) episode reward, its per-turn rewards summed, times
  ``env.reward_weight``;
* :class:`ScoredRewards`: the reward functions (in the driver, or on a pool of actors), the HTTP reward and the
  LLM judge (:class:`rlhf.rewards.scoring.RewardScorers`); ``reward.on_error=drop`` marks the samples it failed on;
* :class:`RewardModelReward`: the reward model's score of each whole row, times ``reward.model_weight``.

:class:`StepScoring` sums them in that order, then shapes: DAPO's soft overlong punishment
(``rollout.overlong_buffer``), and ``rollout.episode_limit``: ``penalize`` replaces the score of a sample a limit
ended, ``mask`` takes its loss away after its score entered the group baselines (:meth:`StepScoring.trained_rows`).
A sample a source failed on is out of every statistic of the step (:mod:`rlhf.ops.failures`); the trainer leaves it
out of the advantages. The per-turn credit an environment gave (``algo.turn_credit=turn``) is weighted here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from rlhf.batch import Batch
from rlhf.config.rl_schema import RLRunConfig
from rlhf.objectives.actor_critic import SequenceScores
from rlhf.ops.dapo import OVERLONG_SOURCE, overlong_penalty
from rlhf.rewards.functions import RewardFunctionScorer, metric_names
from rlhf.rewards.scoring import RewardScorers
from rlhf.rollout.prompts import PromptSet
from rlhf.rollout.sources import Rollout


@dataclass(frozen=True)
class Samples:
    """A step's samples as the reward sources read them: the rollout (its responses, rows, episode rewards), each
    sample's prompt text and its data columns (the prompt row's ``reward.columns``, and an episode's)."""

    rollout: Rollout
    prompts: List[str]
    columns: Dict[str, list]

    @staticmethod
    def of(rollout: Rollout, prompt_set: PromptSet) -> "Samples":
        index = rollout.prompt_index
        columns = {**{k: [v[i] for i in index] for k, v in prompt_set.columns.items()}, **rollout.columns}
        return Samples(rollout, [prompt_set.texts[i] for i in index], columns)


@dataclass(frozen=True)
class Scores:
    """What one source adds to a step: ``total`` ``(B,)`` (weighted), its values ``{name: (B,)}`` as logged
    (unweighted), ``failed`` ``(B,)`` bool (``None``: it fails on none) and its own metrics."""

    total: torch.Tensor
    per_source: Dict[str, torch.Tensor]
    failed: Optional[torch.Tensor] = None
    metrics: Dict[str, float] = field(default_factory=dict)


class RewardSource(Protocol):
    def score(self, samples: Samples) -> Optional[Scores]:
        """The source's scores of ``samples``; ``None`` when it has nothing for them (no episode reward)."""
        ...


class EnvironmentReward:
    """The episode reward of an environment or an agent (``rollout.env_rewards``), times ``weight``."""

    def __init__(self, weight: float) -> None:
        self.weight = weight

    def score(self, samples: Samples) -> Optional[Scores]:
        env = samples.rollout.env_rewards
        if env is None:
            return None
        return Scores(self.weight * env, {"env": env})


class ScoredRewards:
    """The reward functions, the HTTP reward and the judge (:class:`RewardScorers`), each value logged as
    ``reward/<file.py:function>`` (not the file's whole path); the samples ``reward.on_error=drop`` dropped are
    failed. The failure counts are logged when something can fail by sample (a pool, HTTP, the judge)."""

    def __init__(self, scorers: RewardScorers) -> None:
        self.scorers = scorers

    def score(self, samples: Samples) -> Optional[Scores]:
        s, rollout = self.scorers, samples.rollout
        scored = s.score(samples.prompts, rollout.responses, samples.columns, groups=rollout.prompt_index)
        logged = metric_names(list(scored.per_source))
        metrics = scored.metrics() if s.pool is not None or s.http is not None or s.judge is not None else {}
        if s.judge is not None:
            metrics.update(s.judge.metrics())
        per_source = {logged[name]: values for name, values in scored.per_source.items()}
        return Scores(scored.total, per_source, scored.failed, metrics)


class RewardModelReward:
    """The reward model's score of each whole row (prompt and response, or the episode), times ``weight``."""

    def __init__(self, reward_model, weight: float) -> None:
        self.reward_model, self.weight = reward_model, weight

    def score(self, samples: Samples) -> Optional[Scores]:
        rm = self.reward_model.score_batch(samples.rollout.batch, SequenceScores())
        return Scores(self.weight * rm, {"reward_model": rm})


def scored_rewards(
    cfg: RLRunConfig, functions: Optional[RewardFunctionScorer], pool: Optional[Any], judge: Optional[Any]
) -> Optional[RewardScorers]:
    """The reward functions (in the driver, or on the plan's reward actors, ``pool``), the remote reward
    (``reward.http``) and the LLM judge (``judge``, the plan's), or ``None`` when the run has none of them."""
    w = cfg.reward
    http = None
    if w.http:
        from rlhf.rewards.remote import HttpReward  # urllib and threads: only a run with a remote reward needs it

        http = HttpReward(
            w.http,
            batch_size=w.http_batch_size,
            timeout_s=w.timeout_s,
            retries=w.http_retries,
            backoff_s=w.http_backoff_s,
            concurrency=w.http_concurrency,
            on_error=w.failure_policy,
            weight=w.http_weight,
        )
    if pool is not None:
        functions = None  # scored on the actors
    if functions is None and pool is None and http is None and judge is None:
        return None
    return RewardScorers(functions=functions, pool=pool, http=http, judge=judge)


def reward_sources(cfg: RLRunConfig, scorers: Optional[RewardScorers], reward_model=None) -> Tuple[RewardSource, ...]:
    """The run's sources, in the order their scores are summed: the environment's (multi-turn), the scored
    rewards, the reward model's."""
    sources: List[RewardSource] = [EnvironmentReward(cfg.env.reward_weight)]
    if scorers is not None:
        sources.append(ScoredRewards(scorers))
    if reward_model is not None:
        sources.append(RewardModelReward(reward_model, cfg.reward.model_weight))
    return tuple(sources)


class StepScoring:
    """A step's reward: its sources summed, shaped and limited (module docstring).

    Args:
        cfg: the run config (``rollout.*`` shaping and limits, ``env.reward_weight``, ``algo.turn_credit``).
        sources: :func:`reward_sources`.
    """

    def __init__(self, cfg: RLRunConfig, sources: Sequence[RewardSource]) -> None:
        self.cfg, self.sources = cfg, tuple(sources)

    def score(self, rollout: Rollout, prompt_set: PromptSet) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Summed reward per sample ``(B,)`` float32 and each source's ``(B,)`` values. The samples a source failed
        on are marked in ``rollout.reward_failed`` (out of the step), its metrics added to ``rollout.metrics``.
        With ``rollout.episode_limit=penalize`` a sample a limit ended gets ``rollout.limit_reward`` instead."""
        samples = Samples.of(rollout, prompt_set)
        total = torch.zeros(len(rollout.prompt_index))
        per_source: Dict[str, torch.Tensor] = {}
        failed: Optional[torch.Tensor] = None
        for source in self.sources:
            scores = source.score(samples)
            if scores is None:
                continue
            total, per_source = total + scores.total, {**per_source, **scores.per_source}
            if scores.failed is not None:
                failed = scores.failed if failed is None else failed | scores.failed
            rollout.metrics.update(scores.metrics)
        if failed is not None:  # reward.on_error=drop: out of the step (rlhf.ops.failures)
            rollout.reward_failed = failed
        r = self.cfg.rollout
        if r.overlong_buffer:  # DAPO's soft overlong punishment, on the response's length
            assert rollout.batch.loss_mask is not None, "a rollout batch carries its loss mask"
            lengths = rollout.batch.loss_mask.sum(-1)
            shaping = overlong_penalty(lengths, r.max_new_tokens, r.overlong_buffer, r.overlong_penalty)
            per_source[OVERLONG_SOURCE] = shaping
            total = total + shaping
        if r.episode_limit == "penalize" and rollout.at_limit is not None:
            total = torch.where(rollout.at_limit, torch.tensor(r.limit_reward, dtype=total.dtype), total)
        return total.float(), per_source

    def trained_rows(self, batch: Batch, rollout: Rollout) -> Batch:
        """``batch`` as the update sees it: with ``rollout.episode_limit=mask``, the samples a limit ended carry no
        loss (their scores still entered their groups' baselines: DAPO's overlong filtering). Failed samples are
        out already (the trainer's advantages)."""
        if self.cfg.rollout.episode_limit != "mask" or rollout.at_limit is None or not bool(rollout.at_limit.any()):
            return batch
        assert batch.loss_mask is not None, "a rollout batch carries its loss mask"
        keep = (~rollout.at_limit).to(batch.loss_mask.dtype)
        return batch.replace(loss_mask=batch.loss_mask * keep[:, None])

    def turn_credit(self, rollout: Rollout) -> Optional[torch.Tensor]:
        """``(B, T)`` the environment's per-turn rewards, weighted as in :meth:`score`, at each turn's last policy
        token (``algo.turn_credit=turn``; else ``None``). An episode whose score ``rollout.episode_limit=penalize``
        replaced keeps no turn rewards: its score is the limit's reward alone."""
        if self.cfg.algo.turn_credit != "turn":
            return None
        assert rollout.turn_rewards is not None, "algo.turn_credit=turn is checked to need episodes (env.spec)"
        placed = self.cfg.env.reward_weight * rollout.turn_rewards
        if self.cfg.rollout.episode_limit == "penalize" and rollout.at_limit is not None:
            placed = placed * (~rollout.at_limit)[:, None]
        return placed
