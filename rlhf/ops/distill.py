"""On-policy distillation from a frozen teacher: the per-token reverse KL of the policy from the teacher on the
tokens the policy sampled.

The student ``pi`` samples ``y``; the teacher ``nu`` scores every sampled token. With ``x_t = log pi(y_t|s_t) -
log nu(y_t|s_t)`` the reverse KL ``KL(pi(.|s_t) || nu(.|s_t)) = E_{y_t ~ pi}[x_t]`` is estimated per token by
Schulman's ``k1 = x``, ``k2 = x^2 / 2`` or ``k3 = exp(-x) + x - 1`` (:mod:`rlhf.ops.kl`). Agarwal et al. 2024 (GKD,
"On-Policy Distillation of Language Models"), section 3, train on the student's own samples against the teacher's
per-token distribution; the "on-policy distillation" recipe of late 2025 (Thinking Machines; verl's OPD, slime) keeps
only the sampled token's teacher log-prob, which is what crosses the actors here: ``(B, T)``.

Two ways in (``algo.teacher.mode``):

* ``reward``: ``-coef x k_t`` in the token rewards (``k1`` by default, detached), read by the estimators that read
  token rewards (GAE, the REINFORCE++ family); over a response, the return-to-go of ``-k1`` is the policy gradient
  of the sequence-level reverse KL (gamma 1).
* ``loss``: ``coef x k_t`` added to each response token's policy loss, differentiated through ``log pi`` with the
  samples held fixed; ``k2`` by default, whose expected gradient is the reverse KL's (``k1``'s is 0: refused, as for
  the KL-to-reference loss; ``k3``'s is the forward KL's).

Either way the term is aggregated with the rest of the policy loss once, over the whole global batch
(:mod:`rlhf.ops.aggregation`): no micro-batch statistic enters it (verl#7200 normalised it per micro-batch).

Departures: the log-ratio is only held within ``+-LOG_RATIO_GUARD`` against overflow, not bounded to ``+-10`` as the
KL to the reference is (a weak student is far from its teacher; the bound would zero most of the signal). In reward
mode the student's log-prob is the trainer's ``pi_old`` (as for the KL penalty), not the sampler's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlhf.ops.kl import KL_ESTIMATORS, kl_estimate
from rlhf.registry import Registry

Tensor = torch.Tensor

DISTILL_MODES = ("reward", "loss")
#: ``auto``'s estimator per mode: k1 as a reward (its return-to-go is the reverse KL's policy gradient), k2 as a loss.
AUTO_ESTIMATOR = {"reward": "k1", "loss": "k2"}
#: ``|log pi - log nu|`` is held within this before the estimator: ``exp(-x)`` (k3) stays finite in float32.
LOG_RATIO_GUARD = 30.0


def resolve_estimator(estimator: str, mode: str) -> str:
    """The KL estimator of the distillation term: ``estimator``, or for ``auto`` the mode's default.

    Raises:
        ValueError: An unknown mode or estimator, or an estimator without a loss gradient used as a loss.
    """
    if mode not in DISTILL_MODES:
        raise ValueError(f"unknown distillation mode {mode!r}; valid: {', '.join(DISTILL_MODES)}")
    name = AUTO_ESTIMATOR[mode] if estimator == "auto" else estimator
    entry = KL_ESTIMATORS.get(name)  # an unknown name: the valid ones listed
    if mode == "loss" and not entry.usable_as_loss:
        raise ValueError(f"{name} has no gradient in expectation as a loss; use k2 (reverse KL) or k3, or auto")
    return name


def teacher_divergence(estimator: str, logps: Tensor, teacher_logps: Tensor, mask: Tensor) -> Tensor:
    """Per-token reverse-KL estimate of the policy from the teacher on the sampled tokens, 0 off the mask.

    Args:
        estimator: ``k1``, ``k2`` or ``k3``.
        logps: ``(B, T)`` the policy's log-probs of the sampled tokens (differentiable in loss mode).
        teacher_logps: ``(B, T)`` the teacher's log-probs of the same tokens.
        mask: ``(B, T)`` bool, the response tokens the policy sampled.

    Returns:
        ``(B, T)`` in at least float32 (float64 for float64 inputs). Off the mask the teacher is replaced by the
        policy itself (log-ratio 0, no gradient), so whatever the padding holds reaches neither value nor gradient.
    """
    if logps.shape != teacher_logps.shape or logps.shape != mask.shape:
        shapes = f"{tuple(logps.shape)}, {tuple(teacher_logps.shape)}, {tuple(mask.shape)}"
        raise ValueError(f"logps, teacher_logps and mask must share one (B, T) shape; got {shapes}")
    mask = mask.to(torch.bool)
    teacher = torch.where(mask, teacher_logps.detach().to(logps.dtype), logps.detach())
    divergence = kl_estimate(estimator, logps, teacher, clamp=LOG_RATIO_GUARD)
    return torch.where(mask, divergence, torch.zeros((), dtype=divergence.dtype))


def distill_reward_penalty(
    coef: float, estimator: str, old_logps: Tensor, teacher_logps: Tensor, mask: Tensor
) -> Tensor:
    """``coef x`` :func:`teacher_divergence` of the policy that sampled (``pi_old``), detached: the per-token penalty
    that reward mode subtracts from the token rewards, ``(B, T)``."""
    return (coef * teacher_divergence(estimator, old_logps, teacher_logps, mask)).detach()


def teacher_kl(old_logps: Tensor, teacher_logps: Tensor, mask: Tensor) -> float:
    """The mean ``k1`` (``log pi_old - log nu``) over the response tokens: the reverse KL the run reports
    (``distill/teacher_kl``), whatever the mode and estimator."""
    k1 = teacher_divergence("k1", old_logps, teacher_logps, mask)
    return float(k1.sum() / mask.sum().clamp(min=1))


# ---------------------------------------------------------------------------------------------------- GKD divergences
# Agarwal et al. 2024 (GKD), section 3 and eq. 1: divergences between the teacher's and the student's whole
# next-token distributions, on the teacher's top-k tokens plus one bucket for the rest of the vocabulary (both
# distributions coarse-grained alike: a divergence >= 0, <= the full one by the data-processing inequality, exact
# when k covers the vocabulary). The teacher's top-k crosses the actors as (B, T, K) fields (TeacherTopK in
# rlhf.objectives.actor_critic); the student's log-probs at those ids come from its own forward
# (rlhf.models.head.token_outputs).


@dataclass(frozen=True)
class Divergence:
    """What a distillation divergence (``algo.teacher.divergence``) compares and needs.

    Attributes:
        title: its name in prose (the dry run's line).
        sampled: on the sampled tokens alone (the teacher's ``(B, T)`` log-probs; a KL estimator), else on the
            whole next-token distributions (the teacher's ``(B, T, K)`` top-k; loss mode only, no sampling filter).
        beta: reads ``algo.teacher.beta``.
        paper: where it comes from.
    """

    title: str
    sampled: bool
    beta: bool
    paper: str


DIVERGENCES = Registry[Divergence]("distillation divergence")
DIVERGENCES.register("reverse_kl")(
    Divergence(
        "reverse KL",
        sampled=True,
        beta=False,
        paper="GKD section 3; on-policy distillation (TM 2025): KL(student || teacher)",
    )
)
DIVERGENCES.register("forward_kl")(
    Divergence("forward KL", sampled=False, beta=False, paper="GKD section 3: KL(teacher || student)")
)
DIVERGENCES.register("jsd")(
    Divergence("generalised JSD", sampled=False, beta=True, paper="GKD eq. 1: the generalised JSD with beta")
)
#: the divergence on the sampled tokens (the default)
SAMPLED = "reverse_kl"


def check_divergence(name: str, beta: float) -> Divergence:
    """The registry entry of ``name``, with ``beta`` checked where it is read.

    Raises:
        UnknownNameError: an unknown name (the valid ones listed); ValueError: ``beta`` outside ``(0, 1)``.
    """
    entry = DIVERGENCES.get(name)
    if entry.beta and not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1) (0 and 1 give 0: use forward_kl or reverse_kl), got {beta}")
    return entry


#: A tail bucket's mass is floored here before its log: a top-k that holds (numerically) all of the mass leaves a
#: bucket of ~0, whose log must stay finite for the gradient.
TAIL_FLOOR = 1e-30


def with_tail(topk_logps: Tensor) -> Tensor:
    """``(..., K)`` log-probs of K distinct tokens -> ``(..., K + 1)``: the same, then the log of the mass of every
    other token, ``log(1 - sum exp)``, floored at ``log(TAIL_FLOOR)``."""
    kept = torch.logsumexp(topk_logps, dim=-1, keepdim=True).clamp(max=0.0)
    tail = torch.log((-torch.expm1(kept)).clamp(min=TAIL_FLOOR))
    return torch.cat([topk_logps, tail], dim=-1)


def forward_kl(student_logps: Tensor, teacher_logps: Tensor) -> Tensor:
    """``KL(p || q) = sum_v p(v) (log p(v) - log q(v))`` over the last dim, ``p`` the teacher's, ``q`` the student's
    (log-probs of the same outcomes, each summing to 1); ``0 log 0 = 0``. ``(..., V) -> (...)``."""
    p = teacher_logps.exp()
    return torch.where(p > 0, p * (teacher_logps - student_logps), torch.zeros((), dtype=p.dtype)).sum(-1)


def generalized_jsd(student_logps: Tensor, teacher_logps: Tensor, beta: float) -> Tensor:
    """GKD eq. 1: ``beta KL(p || m) + (1 - beta) KL(q || m)`` with ``m = beta p + (1 - beta) q``, ``p`` the
    teacher's, ``q`` the student's distribution over the last dim. ``(..., V) -> (...)``.

    ``beta`` must be in ``(0, 1)``: at the ends the value is 0 (``JSD(beta) = beta KL(p || q) + O(beta^2)``); TRL's
    convention of reading ``beta = 0`` / ``1`` as the forward / reverse KL is a different objective, named as such.
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1) (0 and 1 give 0: use the forward or reverse KL), got {beta}")
    log_m = torch.logsumexp(torch.stack([teacher_logps + math.log(beta), student_logps + math.log1p(-beta)]), dim=0)
    return beta * forward_kl(log_m, teacher_logps) + (1.0 - beta) * forward_kl(log_m, student_logps)


def topk_divergence(
    name: str, student_topk_logps: Tensor, teacher_topk_logps: Tensor, mask: Tensor, beta: float = 0.5
) -> Tensor:
    """Per-token divergence of the student's next-token distribution from the teacher's, on the teacher's top-k
    tokens plus a tail bucket (:func:`with_tail` on both sides), 0 off the mask.

    Args:
        name: ``forward_kl`` (``KL(teacher || student)``) or ``jsd`` (:func:`generalized_jsd` with ``beta``).
        student_topk_logps: ``(B, T, K)`` the student's log-probs of the teacher's top-k tokens at each position
            (differentiable).
        teacher_topk_logps: ``(B, T, K)`` the teacher's log-probs of its top-k tokens.
        mask: ``(B, T)`` bool, the response tokens whose predicting distributions are compared.

    Returns:
        ``(B, T)`` in the student's dtype. Off the mask both sides are replaced by a fixed distribution before the
        divergence (so whatever the padding holds reaches neither value nor gradient).
    """
    if student_topk_logps.shape != teacher_topk_logps.shape or student_topk_logps.shape[:-1] != mask.shape:
        shapes = f"{tuple(student_topk_logps.shape)}, {tuple(teacher_topk_logps.shape)}, {tuple(mask.shape)}"
        raise ValueError(f"student and teacher top-k log-probs must be (B, T, K) over a (B, T) mask; got {shapes}")
    keep = mask.to(torch.bool)[..., None]
    uniform = torch.full((), -math.log(student_topk_logps.shape[-1] + 1), dtype=student_topk_logps.dtype)
    student = torch.where(keep, student_topk_logps, uniform)
    teacher = torch.where(keep, teacher_topk_logps.detach().to(student.dtype), uniform)
    student, teacher = with_tail(student), with_tail(teacher)
    if name == "forward_kl":
        divergence = forward_kl(student, teacher)
    elif name == "jsd":
        divergence = generalized_jsd(student, teacher, beta)
    else:
        raise ValueError(f"unknown distribution divergence {name!r}; valid: forward_kl, jsd")
    return torch.where(mask.to(torch.bool), divergence, torch.zeros((), dtype=divergence.dtype))
