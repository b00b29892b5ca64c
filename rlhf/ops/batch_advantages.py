"""``advantages_for``: a registered advantage estimator over a whole rollout batch (the one path the built-in RL
trainer and a custom loop both take): the KL penalty in the reward, the failed samples left out
(:mod:`rlhf.ops.failures`), the estimator (:data:`rlhf.ops.advantages.ADVANTAGE_ESTIMATORS`) and the batch
whitening, each over every sample of the rollout, never a micro-batch."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union, overload

import torch

from rlhf.batch import Batch
from rlhf.ops.advantages import ADVANTAGE_ESTIMATORS, TOKEN_REWARDS, AdvantageInputs, token_level_rewards, whiten
from rlhf.ops.distill import distill_reward_penalty, teacher_kl
from rlhf.ops.failures import rows_out
from rlhf.ops.kl import kl_estimate


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
    distill_coef: float = 0.0,
    distill_estimator: str = "k1",
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
        distill_coef: > 0: on-policy distillation in the reward (``algo.teacher.mode=reward``), the per-token penalty
            ``distill_coef x`` the ``distill_estimator`` reverse KL of ``old_logps`` from ``batch.teacher_logps``
            (:mod:`rlhf.ops.distill`), for estimators that read token rewards.

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
    distill = _distill(batch, kept, kept_mask, distill_coef, distill_estimator)
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
        distill=distill,
    )
    if whiten_advantages != "none" and bool(kept_mask.any()):
        advantages = whiten(advantages, kept_mask, shift_mean=whiten_advantages == "whiten")
    stats = {
        "reward_kl_penalty": float(penalty.sum() / kept_mask.sum().clamp(min=1)) if penalty is not None else 0.0,
        "failed/rows_out": 0 if out is None else int(out.sum()),
    }
    if batch.teacher_logps is not None:
        assert batch.old_logps is not None, "the teacher is compared with the policy that sampled"
        stats["distill/teacher_kl"] = teacher_kl(
            kept.take(batch.old_logps), kept.take(batch.teacher_logps), kept_mask != 0
        )
    if distill is not None:
        stats["distill/reward_penalty"] = float(distill.sum() / kept_mask.sum().clamp(min=1))
    fields = {"advantages": kept.put(advantages, mask), "returns": kept.put(returns, mask)}
    if out is not None:
        fields["loss_mask"] = batch.loss_mask * (~out).to(batch.loss_mask.dtype)[:, None]
    return batch.replace(**fields), stats


def _distill(
    batch: Batch, kept: "_Rows", kept_mask: torch.Tensor, coef: float, estimator: str
) -> Optional[torch.Tensor]:
    """The kept rows' per-token distillation penalty ``(B', T)`` (reward mode), or None without one."""
    if not coef:
        return None
    if batch.teacher_logps is None or batch.old_logps is None:
        raise ValueError("distillation in the reward needs batch.old_logps and batch.teacher_logps (the teacher's)")
    return distill_reward_penalty(
        coef, estimator, kept.take(batch.old_logps), kept.take(batch.teacher_logps), kept_mask != 0
    )


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
    distill: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The estimator ``entry`` on the rows given (``(B', T)`` each): ``(advantages, returns, KL penalty or None)``;
    ``kl`` is ``(kl_coef, kl_estimator)`` for a KL penalty in the reward, ``distill`` a per-token distillation
    penalty (for estimators that read token rewards). No row (every sample out): zeros."""
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
    token_penalty = penalty if per_token else None
    if distill is not None:
        if TOKEN_REWARDS not in entry.reads:
            raise ValueError("a distillation penalty in the reward needs an estimator that reads token rewards")
        token_penalty = distill if token_penalty is None else token_penalty + distill
    placed = None if turn_rewards is None else turn_rewards.to(scores.dtype)
    rewards = token_level_rewards(scores, mask, token_penalty, 1.0, placed)
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
