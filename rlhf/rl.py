"""What a custom online-RL loop needs, in one place (docs/custom_loops.md walks a loop built from it).

One RL step from these parts::

    generations = engines.generate(prompt_ids, SamplingSpec(...))             # rlhf.rollout
    batch = rollout_batch(generations, pad_id)                                 # (B, T), responses masked
    batch = batch.replace(old_logps=policy.score_batch(batch, TokenLogps()))   # pi_old per token
    batch, _ = advantages_for(batch, rewards, group_ids, estimator="rloo")     # over the whole rollout batch
    result = policy.train_batch(batch, PolicyObjective())                      # one exact optimizer step
    policy.push_weights()                                                      # into the engines

The worker group cuts the batch into ranks and micro-batches and counts the loss normalizer over the whole batch
(:meth:`rlhf.distributed.group.WorkerGroup.train_batch`); the advantages see every sample of the rollout (group
baselines and whitening never see a micro-batch). Nothing here starts an actor.

Sampling with ``temperature``, ``top_k`` or ``top_p`` in the ``SamplingSpec``: score with the same ones,
``TokenLogps(temperature=t, sampling_filter=SamplingFilter(top_k=k, top_p=p))`` and ``PolicyObjective(temperature=t,
sampling_filter=...)``. The trainer's log-probs are then those of the renormalised kept set vLLM sampled from and
reports (``logp_mismatch`` ~1e-6); without the filter every ratio is off by the kept probability mass.

Multi-turn episodes replace the first two lines: ``records = run_episodes(engines, environments, prompt_ids, rows,
sampling, encode, decode, TurnLimits(...))`` then ``episodes_batch([r.episode for r in records], pad_id)``; only
the policy's sampled tokens carry loss (rlhf/rollout/episodes.py). ``encode`` is ``TextObservations.of(tokenizer)``
or ``ChatObservations(chat, role)`` (a chat template's observation turns; a reset observation is rendered onto
the episode's own prompt: pass ``prompt_messages=``, and ``prompt_tools=`` for prompts rendered with tools, aligned
with ``prompt_ids``), or any ``text -> ids`` function.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union, overload

import torch

from rlhf.batch import Batch
from rlhf.objectives.actor_critic import PolicyObjective, SequenceScores, TokenLogps, TokenValues, ValueObjective
from rlhf.ops.advantages import ADVANTAGE_ESTIMATORS, TOKEN_REWARDS, AdvantageInputs, token_level_rewards, whiten
from rlhf.ops.failures import rows_out
from rlhf.ops.kl import kl_estimate
from rlhf.ops.logprobs import SamplingFilter
from rlhf.ops.policy_loss import PolicyLossConfig
from rlhf.rollout.engines import RolloutEngines
from rlhf.rollout.episodes import Episode, EpisodeError, episodes_batch, turn_reward_tokens
from rlhf.rollout.multi_turn import EpisodeRecord, TurnLimits, episode_metrics, run_episodes
from rlhf.rollout.observations import ChatObservations, TextObservations
from rlhf.rollout.vllm_engine import Generation, SamplingSpec, VLLMSpec

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ChatObservations",
    "Episode",
    "EpisodeError",
    "EpisodeRecord",
    "Generation",
    "PolicyLossConfig",
    "PolicyObjective",
    "RolloutEngines",
    "SamplingFilter",
    "SamplingSpec",
    "SequenceScores",
    "TextObservations",
    "TokenLogps",
    "TokenValues",
    "TurnLimits",
    "VLLMSpec",
    "ValueObjective",
    "advantages_for",
    "episode_metrics",
    "episodes_batch",
    "turn_reward_tokens",
    "logp_mismatch",
    "logp_mismatch_max",
    "rollout_batch",
    "run_episodes",
]


def rollout_batch(generations: Sequence, pad_id: int) -> Batch:
    """Single-turn generations (``rlhf.rollout.vllm_engine.Generation``) -> one right-padded ``(B, T)`` batch.

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


def advantages_for(
    batch: Batch,
    scores: Union[torch.Tensor, Sequence[float]],
    group_ids: Union[torch.Tensor, Sequence[int], None] = None,
    *,
    estimator: str,
    gamma: float = 1.0,
    lam: float = 1.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_in_reward: bool = False,
    whiten_advantages: str = "none",
    turn_rewards: Optional[torch.Tensor] = None,
    failed: Optional[torch.Tensor] = None,
) -> Tuple[Batch, dict]:
    """Attach ``advantages`` and ``returns`` (``(B, T)``) to the whole rollout batch; returns it with KL stats.

    Args:
        batch: the rollout batch; ``old_logps`` (and ``ref_logps`` for a KL in the reward), ``values`` for
            an estimator that needs a critic.
        scores: ``(B,)`` sequence rewards.
        group_ids: ``(B,)`` the prompt of each sample; needed by the estimators that compare a prompt's samples
            (``needs_group_ids`` in their registry entry).
        estimator: a name of :data:`ADVANTAGE_ESTIMATORS` (``gae``, ``grpo``, ``dr_grpo``, ``rloo``,
            ``reinforce_pp``, ...). The defaults are the estimators' own: no discount, ``lam`` 1, no KL,
            no extra whitening (REINFORCE++ whitens as part of the estimator).
        kl_in_reward: a KL penalty ``kl_coef x KL(old || ref)`` (``kl_estimator``, each token's value within
            ``+-KL_VALUE_BOUND``) in the reward, where the estimator reads rewards (``Estimator.kl_in_reward``):
            per token for those that read token rewards (GAE, REINFORCE++), summed over each response and
            subtracted from its score for those that read sequence scores only (GRPO, Dr. GRPO, RLOO: the
            sequence-level KL reward of Ahmadian et al. 2024), before any group statistic.
        whiten_advantages: ``none``; ``whiten`` (subtract the batch mean, divide by the batch std, over every
            response token of the whole rollout batch); ``scale`` (divide by the std only, keeping each sign).
        turn_rewards: ``(B, T)`` per-turn credit (``algo.turn_credit=turn``): the part of ``scores`` an environment
            gave turn by turn, each at its turn's last policy token (:func:`rlhf.rollout.episodes.turn_reward_tokens`);
            only for estimators that read token rewards (the group statistics still see the whole ``scores``).
        failed: ``(B,)`` bool, the samples whose reward is a placeholder (a reward source, environment or agent
            failed under ``on_error=drop``). They, and for a group estimator their whole groups, are out of the step
            (:mod:`rlhf.ops.failures`): the estimator runs on the other rows alone, the rows out get advantage,
            return and loss mask 0, and their ``scores`` are never read (any value, NaN included, gives the same).

    Returns:
        The batch with ``advantages`` and ``returns`` (and, with ``failed``, the rows out of the step masked), and
        ``{"reward_kl_penalty": ..., "failed/rows_out": ...}``: the mean per-token penalty ``kl_coef x KL`` over the
        kept response tokens (0 without one), the same number however it entered, and how many rows are out.
    """
    entry = ADVANTAGE_ESTIMATORS.get(estimator)  # an unknown name is refused with the valid ones
    if entry.needs_group_ids and group_ids is None:
        raise ValueError(f"estimator {estimator!r} compares the samples of a prompt: pass group_ids (B,)")
    if entry.needs_critic and batch.values is None:
        raise ValueError(
            f"estimator {estimator!r} needs batch.values (the critic's, e.g. critic.score_batch(batch, TokenValues()))"
        )
    # float64 when the policy's log-probs are (strategy.precision=fp64): the advantages are then float64 too
    fp64 = batch.old_logps is not None and batch.old_logps.dtype == torch.float64
    assert batch.loss_mask is not None, "an experience batch carries its loss mask"
    scores = torch.as_tensor(scores, dtype=torch.float32)
    scores = scores.double() if fp64 else scores
    groups = None if group_ids is None else torch.as_tensor(group_ids, dtype=torch.long)
    if turn_rewards is not None and TOKEN_REWARDS not in entry.reads:
        raise ValueError(f"estimator {estimator!r} reads sequence scores only: it cannot take per-turn rewards")
    out = rows_out(failed, groups, entry.needs_group_ids)
    keep = torch.arange(len(batch)) if out is None else torch.nonzero(~out).squeeze(-1)
    mask = batch.loss_mask.to(torch.float64 if fp64 else torch.float32)
    kept = _Rows(keep, len(batch))
    kept_mask = kept.take(mask)
    advantages, returns, penalty = _estimate(
        entry,
        kept_mask,
        kept.take(scores),
        kept.take(groups),
        kept.take(batch.values),
        kept.take(batch.old_logps),
        kept.take(batch.ref_logps),
        kept.take(turn_rewards),
        gamma=gamma,
        lam=lam,
        kl=(kl_coef, kl_estimator) if kl_in_reward and kl_coef > 0 else None,
    )
    if whiten_advantages != "none" and bool(kept_mask.any()):
        advantages = whiten(advantages, kept_mask, shift_mean=whiten_advantages == "whiten")
    stats = {
        "reward_kl_penalty": float(penalty.sum() / kept_mask.sum().clamp(min=1)) if penalty is not None else 0.0,
        "failed/rows_out": 0 if out is None else int(out.sum()),
    }
    fields = {"advantages": kept.put(advantages, mask), "returns": kept.put(returns, mask)}
    if out is not None:
        fields["loss_mask"] = batch.loss_mask * (~out).to(batch.loss_mask.dtype)[:, None]
    return batch.replace(**fields), stats


class _Rows:
    """The rows of a ``(B, ...)`` batch that an estimator sees (:func:`advantages_for` with ``failed``)."""

    def __init__(self, keep: torch.Tensor, total: int) -> None:
        self.keep, self.total = keep, total

    @overload
    def take(self, x: torch.Tensor) -> torch.Tensor: ...
    @overload
    def take(self, x: None) -> None: ...
    @overload
    def take(self, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]: ...

    def take(self, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The kept rows of ``x`` (``x`` itself when every row is kept or ``x`` is ``None``)."""
        return x if x is None or len(self.keep) == self.total else x[self.keep]

    def put(self, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``x`` (the kept rows) back in place in a ``like``-shaped tensor, 0 on the rows out."""
        if len(self.keep) == self.total:
            return x
        full = torch.zeros(like.shape, dtype=x.dtype)
        full[self.keep] = x
        return full


def _estimate(
    entry,
    mask: torch.Tensor,
    scores: torch.Tensor,
    groups: Optional[torch.Tensor],
    values: Optional[torch.Tensor],
    old_logps: Optional[torch.Tensor],
    ref_logps: Optional[torch.Tensor],
    turn_rewards: Optional[torch.Tensor],
    *,
    gamma: float,
    lam: float,
    kl: Optional[Tuple[float, str]],
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The estimator ``entry`` on the rows given (``(B', T)`` each): ``(advantages, returns, KL penalty or None)``;
    ``kl`` is ``(kl_coef, kl_estimator)`` for a KL penalty in the reward. No row (every sample out): zeros."""
    penalty = None
    if not len(mask):
        return torch.zeros_like(mask), torch.zeros_like(mask), None
    if kl is not None:
        if ref_logps is None:
            raise ValueError("kl_in_reward needs batch.ref_logps (the reference's log-probs)")
        assert old_logps is not None, "the KL penalty is taken against the policy's log-probs"
        kl_coef, kl_estimator = kl
        penalty = kl_coef * torch.where(mask != 0, kl_estimate(kl_estimator, old_logps, ref_logps, bounded=True), 0.0)
    per_token = penalty is not None and entry.kl_in_reward == "per token"
    if penalty is not None and not per_token:
        scores = scores - penalty.sum(-1).to(scores.dtype)
    placed = None if turn_rewards is None else turn_rewards.to(scores.dtype)
    rewards = token_level_rewards(scores, mask, penalty if per_token else None, 1.0, placed)
    inputs = AdvantageInputs(
        token_rewards=rewards,
        scores=scores,
        response_mask=mask,
        values=values,
        group_ids=groups,
        gamma=gamma,
        lam=lam,
    )
    advantages, returns = entry.fn(inputs)
    return advantages, returns, penalty


def logp_mismatch(batch: Batch) -> Optional[float]:
    """Mean |trainer log-prob - vLLM log-prob| over response tokens (same weights, same tokens): ~1e-7 when
    every weight sync landed."""
    gap = _response_gaps(batch)
    if gap is None:
        return None
    assert batch.loss_mask is not None, "an experience batch carries its loss mask"
    return float(gap.sum() / batch.loss_mask.float().sum().clamp(min=1))


def logp_mismatch_max(batch: Batch) -> Optional[float]:
    """Max |trainer log-prob - vLLM log-prob| over response tokens (0.0 when there are none): beside the mean
    (:func:`logp_mismatch`), because a few tokens far off (one layer not synced, a kernel that differs on rare
    inputs) hide in a mean over thousands of tokens and still skew their ratios."""
    gap = _response_gaps(batch)
    if gap is None:
        return None
    assert batch.loss_mask is not None, "an experience batch carries its loss mask"
    kept = gap[batch.loss_mask != 0]  # (N,) the response tokens
    return float(kept.max()) if kept.numel() else 0.0


def _response_gaps(batch: Batch) -> Optional[torch.Tensor]:
    """``(B, T)`` |old_logps - rollout_logps|, 0 off the response tokens; ``None`` without both log-probs."""
    if batch.old_logps is None or batch.rollout_logps is None:
        return None
    assert batch.loss_mask is not None, "an experience batch carries its loss mask"
    return (batch.old_logps - batch.rollout_logps).abs() * batch.loss_mask.float()
