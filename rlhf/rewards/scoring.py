"""The rule-based, remote and judged rewards of an RL step as one scorer: reward functions (in the driver, serially,
or on a :class:`~rlhf.rewards.pool.RewardPool` of actors with per-sample timeouts), an HTTP reward
(:class:`~rlhf.rewards.remote.HttpReward`) and an LLM judge (:class:`~rlhf.rewards.judge.LLMJudge`), summed into one
:class:`~rlhf.rewards.results.ScoreResult`.

The serial path is :func:`~rlhf.rewards.functions.compute_rewards` as it always was (no timeout: a raising function
stops the run, naming the sample); the pool and the HTTP reward apply ``reward.on_error`` per sample.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional, Sequence

import torch

from rlhf.rewards.results import ScoreResult

__all__ = ["RewardScorers", "reward_scorers"]


class RewardScorers:
    """Reward functions and/or an HTTP reward (at least one).

    Args:
        functions: the reward functions, scored in the driver (``reward.num_workers=0``), or ``None``.
        pool: the reward functions on actors instead (``reward.num_workers >= 1``), or ``None``.
        http: a remote reward (``reward.http``), or ``None``.
        judge: an LLM judge (:class:`rlhf.rewards.judge.LLMJudge`, ``reward.judge.*``), or ``None``.
    """

    def __init__(self, functions: Optional[Callable] = None, pool=None, http=None, judge=None) -> None:
        if functions is not None and pool is not None:
            raise ValueError("reward functions are scored either in the driver or on a pool, not both")
        if functions is None and pool is None and http is None and judge is None:
            raise ValueError("RewardScorers needs reward functions, a reward pool, an HTTP reward or a judge")
        self.functions, self.pool, self.http, self.judge = functions, pool, http, judge

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        columns: Optional[Mapping[str, Sequence]] = None,
        groups: Optional[Sequence[int]] = None,
    ) -> ScoreResult:
        """Every source on the batch: the summed float32 ``(N,)`` total, each source's values, the samples dropped
        by ``reward.on_error=drop`` and the failure counts.

        ``groups`` is each sample's group id (the rollout's ``prompt_index``). Only the judge reads it: a pairwise
        judge ranks a response among its group's, and equal prompt texts do not say which samples share a group
        (two prompt rows of one text, or that render alike). The other sources score each sample alone."""
        results = []
        if self.functions is not None:
            started = time.perf_counter()
            total, per_source = self.functions(prompts, responses, columns)
            none = torch.zeros(len(total), dtype=torch.bool)
            results.append(ScoreResult(total, per_source, none, none.clone(), seconds=time.perf_counter() - started))
        if self.pool is not None:
            results.append(self.pool.score(prompts, responses, columns))
        if self.http is not None:
            results.append(self.http.score(prompts, responses, columns))
        if self.judge is not None:
            results.append(self.judge.score(prompts, responses, columns, groups=groups))
        return results[0] if len(results) == 1 else ScoreResult.merge(results)


def reward_scorers(scorer) -> Optional[RewardScorers]:
    """``scorer`` as :class:`RewardScorers`: a :class:`RewardFunctionScorer` (or a function called as one:
    ``(prompts, responses, columns) -> (total, per_source)``) is scored in the driver; ``None`` stays ``None``."""
    if scorer is None or isinstance(scorer, RewardScorers):
        return scorer
    if callable(scorer):  # a RewardFunctionScorer, or any function with its call: (prompts, responses, columns)
        return RewardScorers(functions=scorer)
    raise TypeError(f"a reward scorer must be a RewardFunctionScorer or RewardScorers, got {type(scorer).__name__}")
